#!/usr/bin/env python3
"""trace-diff.py -- compare two TKV_TRACE files layer by layer.

    TKV_TRACE=/tmp/a.bin tierkv run ... --device cuda
    TKV_TRACE=/tmp/b.bin TKV_CUDA_WEIGHTS=f32 tierkv run ... --device cuda
    python3 scripts/trace-diff.py /tmp/a.bin /tmp/b.bin [--every] [--logits A.gguf B.gguf]

A trace (runtime/engine.c, trace_layer) is one record per layer and chunk:
four uint32 (layer, n_past, n, n_embd), then the residual stream after that
layer, n x n_embd float32, host byte order. Records are paired by (layer,
n_past, n); for each pair the script prints the largest |a - b| and
||a - b|| / ||b|| over the chunk's rows, per layer for the prompt's chunks
and, with --every, for every decode step too (else the worst over the
steps). Pairs stop where the two runs' chunks stop matching (their tokens
differ from there on, or their chunking does). Exit 1 on a malformed file.

--logits A.gguf B.gguf: also the logits of each chunk's last row after the
last layer (output norm and output matrix of each run's model, computed in
double precision from the traced stream; needs `pip install gguf numpy`),
worst relative and absolute difference over the chunks, as test-gpu-e2e
measures them.
"""
import array
import math
import struct
import sys


def records(path):
    out = {}
    with open(path, "rb") as f:
        data = f.read()
    off = 0
    while off < len(data):
        if off + 16 > len(data):
            sys.exit(f"{path}: a record header cut at byte {off}")
        layer, n_past, n, e = struct.unpack_from("=4I", data, off)
        off += 16
        size = n * e * 4
        if off + size > len(data):
            sys.exit(f"{path}: record (layer {layer}, n_past {n_past}) cut at byte {off}")
        v = array.array("f")
        v.frombytes(data[off:off + size])
        out[(layer, n_past, n)] = v
        off += size
    return out


def head_weights(path):
    import gguf
    import numpy as np

    r = gguf.GGUFReader(path)
    w = {}
    for t in r.tensors:
        if t.name in ("token_embd.weight", "output_norm.weight", "output.weight"):
            x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
            w[t.name] = x.reshape(tuple(int(s) for s in reversed(t.shape.tolist())))
    eps = float(r.fields["llama.attention.layer_norm_rms_epsilon"].parts[-1][0])
    return w, eps


def logits_diff(a, b, model_a, model_b):
    import numpy as np

    (wa, ea), (wb, eb) = head_weights(model_a), head_weights(model_b)

    def logits(x, w, eps):
        x = np.asarray(x, dtype=np.float64)
        h = x / np.sqrt((x * x).mean() + eps) * w["output_norm.weight"]
        return w.get("output.weight", w["token_embd.weight"]) @ h

    last = max(k[0] for k in a)
    keys = sorted((k for k in a if k[0] == last and k in b), key=lambda k: k[1])
    rel = mx = 0.0
    for k in keys:
        e = len(a[k]) // k[2]
        la, lb = logits(a[k][-e:], wa, ea), logits(b[k][-e:], wb, eb)
        rel = max(rel, float(np.linalg.norm(la - lb) / np.linalg.norm(lb)))
        mx = max(mx, float(np.abs(la - lb).max()))
    print(f"logits over {len(keys)} chunks: worst rel {rel:.3g}, max abs {mx:.3g}")


def main():
    argv = sys.argv[1:]
    models = None
    if "--logits" in argv:
        i = argv.index("--logits")
        models = argv[i + 1:i + 3]
        del argv[i:i + 3]
    args = [a for a in argv if not a.startswith("--")]
    every = "--every" in argv
    if len(args) != 2 or (models is not None and len(models) != 2):
        sys.exit(__doc__)
    a, b = records(args[0]), records(args[1])
    keys = sorted(set(a) & set(b), key=lambda k: (k[1], k[0]))
    if not keys:
        sys.exit("no record in common")
    n_layer = max(k[0] for k in keys) + 1
    prompt_end = min(k[1] + k[2] for k in keys if k[2] > 1) if any(k[2] > 1 for k in keys) else 0
    worst = {}  # layer -> (max abs, rel) over decode steps
    print(f"{len(keys)} records in common ({len(a)} and {len(b)}); {n_layer} layers")
    print("| where | layer | max abs diff | rel diff |")
    print("|---|---:|---:|---:|")
    for k in keys:
        layer, n_past, n = k
        x, y = a[k], b[k]
        d = max(abs(p - q) for p, q in zip(x, y))
        rel = math.sqrt(sum((p - q) ** 2 for p, q in zip(x, y))) / max(math.sqrt(sum(q * q for q in y)), 1e-30)
        if n > 1 or every:
            print(f"| tokens {n_past}..{n_past + n - 1} | {layer} | {d:.4g} | {rel:.3g} |")
        else:
            w = worst.get(layer, (0.0, 0.0))
            worst[layer] = (max(w[0], d), max(w[1], rel))
    if worst and not every:
        steps = sorted({k[1] for k in keys if k[2] == 1})
        print(f"| worst of {len(steps)} decode steps (from token {prompt_end}) | | | |")
        for layer in sorted(worst):
            print(f"| | {layer} | {worst[layer][0]:.4g} | {worst[layer][1]:.3g} |")
    if models:
        logits_diff(a, b, *models)


if __name__ == "__main__":
    main()
