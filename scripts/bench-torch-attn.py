#!/usr/bin/env python3
"""bench-torch-attn.py -- the torch peer of bench/bench-attn's decode section.

Measures, on the GPU torch sees:
  * the device-to-device copy bandwidth (torch's copy_ of a contiguous 2 GiB
    buffer is one cudaMemcpyAsync; bytes read + bytes written per second):
    the HBM roofline the decode attention is held against;
  * torch.nn.functional.scaled_dot_product_attention for one query token
    (decode) over N keys, 32 query / 8 KV heads (enable_gqa), head_dim 128,
    f16 and bf16, with each SDPA backend that accepts the call and with
    torch's own choice;
and prints them beside our numbers when --ours names the JSON lines that
`bench-attn -s decode -j FILE` wrote. With --prefill N,...: causal prefill of
an N-token prompt (32/8 heads, head_dim 128, f16 and bf16) with the flash and
cuDNN backends, beside `bench-attn -s prefill-long` (TFLOP/s over the causal
FLOPs 4 * hd * H * N(N+1)/2, as bench-attn counts them).

  bench-torch-attn.py [--sizes 32768,131072,1048576] [--prefill 8192,32768,131072]
                      [--ours FILE] [--json OUT]

Timing: CUDA events around batches of back-to-back calls, median of 7
batches, after warm-up (the same protocol as bench-attn's host clock around
a synchronize). Rates count the K and V bytes once (what must be read).
"""
import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F


def time_calls(fn, reps, batches=7):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(batches):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3 / reps)
    return statistics.median(ts)


def copy_bandwidth():
    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    src.random_(0, 255)
    dst = torch.empty_like(src)
    t = time_calls(lambda: dst.copy_(src), 10)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / t / 1e9  # read + written


def sdpa_decode(n_keys, dtype, reps):
    """Seconds per call for each SDPA backend that runs the shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    H, Hkv, hd = 32, 8, 128
    q = torch.randn(1, H, 1, hd, dtype=dtype, device="cuda")
    k = torch.randn(1, Hkv, n_keys, hd, dtype=dtype, device="cuda")
    v = torch.randn(1, Hkv, n_keys, hd, dtype=dtype, device="cuda")
    out = {}
    call = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    try:
        out["default"] = time_calls(call, reps)
    except RuntimeError as e:
        out["default"] = None
        print(f"  torch default, {n_keys} keys, {dtype}: {str(e).splitlines()[0]}", file=sys.stderr)
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                     ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([be]):
                out[name] = time_calls(call, reps)
        except RuntimeError as e:
            out[name] = None
            print(f"  torch {name}, {n_keys} keys, {dtype}: {str(e).splitlines()[0][:120]}", file=sys.stderr)
    del q, k, v
    torch.cuda.empty_cache()
    return out


def sdpa_prefill(n, dtype):
    """Seconds per causal prefill call for the flash and cuDNN backends."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    H, Hkv, hd = 32, 8, 128
    q = torch.randn(1, H, n, hd, dtype=dtype, device="cuda")
    k = torch.randn(1, Hkv, n, hd, dtype=dtype, device="cuda")
    v = torch.randn(1, Hkv, n, hd, dtype=dtype, device="cuda")
    out = {}
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([be]):
                out[name] = time_calls(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                enable_gqa=True), 1, batches=3)
        except RuntimeError as e:
            out[name] = None
            print(f"  torch {name} prefill, {n}, {dtype}: {str(e).splitlines()[0][:120]}", file=sys.stderr)
    del q, k, v
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="32768,131072,1048576")
    ap.add_argument("--ours", help="JSON lines from bench-attn -s decode -j FILE")
    ap.add_argument("--json", help="write the combined results here")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--prefill", default="", help="causal prefill sizes (none by default)")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",") if x]
    ours, ours_pf = {}, {}
    if args.ours:
        with open(args.ours) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    if r.get("op") == "prefill_attention":
                        ours_pf.setdefault(r["n"], {}).update(r)
                    elif r.get("op") == "prefill_attention_variant":
                        # the fastest variant of each precision (rows that failed their check are not written)
                        o = ours_pf.setdefault(r["n"], {})
                        k = "best_" + r["precision"]
                        if k not in o or r["us"] < o[k]["us"]:
                            o[k] = r
                    elif "ctx" in r:
                        ours[r["ctx"]] = r

    dev = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    print(f"device: {dev.name}, {dev.multi_processor_count} SMs; torch {torch.__version__}; "
          f"device-to-device copy {bw:.0f} GB/s (read + write)")
    rows = []
    for n in sizes:
        kv_bytes = 8 * n * 128 * 2 * 2  # f16/bf16 K and V, 8 KV heads
        reps = args.reps if n <= 131072 else max(args.reps // 5, 5)
        res = {"ctx": n, "kv_bytes": kv_bytes, "copy_gbps": bw}
        for dt, name in ((torch.float16, "f16"), (torch.bfloat16, "bf16")):
            for be, t in sdpa_decode(n, dt, reps).items():
                res[f"torch_{name}_{be}_us"] = None if t is None else t * 1e6
        rows.append(res)

    def best(r, dt):
        ts = [v for k, v in r.items() if k.startswith(f"torch_{dt}_") and v is not None]
        return min(ts) if ts else None

    print()
    # ours: bench-attn's default row (inline runs, PDL, L2 prefetch where the view fits); ours
    # views: the engine's decode path (block arrays in device memory)
    print("| keys | KV MB | ours us | ours GB/s | ours % of copy | ours views us | views % of copy "
          "| torch f16 best us | GB/s | % of copy | torch bf16 best us | GB/s | ours / torch f16 time |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        n, kvb = r["ctx"], r["kv_bytes"]
        o = ours.get(n)
        tf, tb = best(r, "f16"), best(r, "bf16")
        f = lambda us: f"{us:.1f}" if us else "-"
        g = lambda us: f"{kvb / us / 1e3:.0f}" if us else "-"
        pc = lambda us: f"{kvb / us / 1e3 / bw * 100:.0f}%" if us else "-"
        ou = o["us"] if o else None
        ov = o.get("us device views") if o else None
        ov = ov if ov and ov > 0 else None
        ratio = f"{ou / tf:.2f}" if ou and tf else "-"
        print(f"| {n} | {kvb / 1e6:.0f} | {f(ou)} | {g(ou)} | {pc(ou)} | {f(ov)} | {pc(ov)} | {f(tf)} | {g(tf)} | {pc(tf)} "
              f"| {f(tb)} | {g(tb)} | {ratio} |")
        if o:
            r["ours"] = o
    print()
    print("per backend (us per call):")
    for r in rows:
        print(f"  {r['ctx']:8d} keys: " + ", ".join(
            f"{k[6:-3]} {v:.1f}" for k, v in r.items() if k.startswith("torch_") and v is not None))
    pf_rows = []
    pf_sizes = [int(x) for x in args.prefill.split(",") if x]
    if pf_sizes:
        print()
        print("causal prefill, 32/8 heads, head_dim 128 (TFLOP/s; ours: f16 KV, f32 Q/out):")
        print("| tokens | ours mma (split) v0 | ours mma16 (f16) v0 | ours mma16, best variant | ours general "
              "| torch flash f16 | torch flash bf16 | torch cuDNN f16 | torch cuDNN bf16 | best mma16 / flash bf16 |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in pf_sizes:
        fl = 4.0 * 128 * 32 * n * (n + 1) / 2
        r = {"n": n, "flops": fl}
        for dt, name in ((torch.float16, "f16"), (torch.bfloat16, "bf16")):
            for be, t in sdpa_prefill(n, dt).items():
                r[f"torch_{be}_{name}_us"] = None if t is None else t * 1e6
        o = ours_pf.get(n, {})
        r["ours"] = o or None
        pf_rows.append(r)
        tf = lambda us: f"{fl / us / 1e6:.1f}" if us and us > 0 else "-"
        ratio, best = "-", o.get("best_mma16")
        best_us = best["us"] if best else o.get("us_mma16", -1)
        best_txt = f"{tf(best_us)} (v{best['variant']})" if best else tf(best_us)
        if best_us > 0 and r.get("torch_flash_bf16_us"):
            ratio = f"{r['torch_flash_bf16_us'] / best_us:.2f}"
        print(f"| {n} | {tf(o.get('us_mma'))} | {tf(o.get('us_mma16'))} | {best_txt} | {tf(o.get('us_general'))} "
              f"| {tf(r.get('torch_flash_f16_us'))} | {tf(r.get('torch_flash_bf16_us'))} "
              f"| {tf(r.get('torch_cudnn_f16_us'))} | {tf(r.get('torch_cudnn_bf16_us'))} | {ratio} |")
    doc = {"device": dev.name, "torch": torch.__version__, "copy_gbps": bw, "decode": rows, "prefill": pf_rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    print()
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
