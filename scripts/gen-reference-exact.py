#!/usr/bin/env python3
"""Float64 reference logits for tests/data/smollm2-exact.txt (not run in CI).

An independent evaluation of the quantized model: the GGUF weights are
dequantized by gguf-py (the llama.cpp project's Python package) and the Llama
forward pass is written here in numpy, in float64, from the math alone
(RMSNorm, adjacent-pair RoPE as GGUF stores Q/K, grouped-query causal
attention, SwiGLU, tied output). For each prompt of smollm2-logits.txt it
records the exact next-token top-10 logits and the log-sum-exp.

    /work/venv-ref/bin/pip install numpy gguf
    /work/venv-ref/bin/python scripts/gen-reference-exact.py models/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def load(path):
    r = GGUFReader(path)
    w = {}
    for t in r.tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float64)
        w[t.name] = a.reshape([int(x) for x in reversed(t.shape)]) if len(t.shape) > 1 else a.reshape(-1)
    def meta(key):
        f = r.fields[key]
        return f.parts[f.data[0]][0]
    hp = dict(n_layer=int(meta("llama.block_count")), n_head=int(meta("llama.attention.head_count")),
              n_head_kv=int(meta("llama.attention.head_count_kv")),
              eps=float(meta("llama.attention.layer_norm_rms_epsilon")), base=float(meta("llama.rope.freq_base")))
    hp["head_dim"] = w["token_embd.weight"].shape[1] // hp["n_head"]
    return w, hp


def forward(w, hp, toks):
    L, H, HKV, hd, eps, base = hp["n_layer"], hp["n_head"], hp["n_head_kv"], hp["head_dim"], hp["eps"], hp["base"]
    emb = w["token_embd.weight"]
    out_w = w.get("output.weight", emb)
    T = len(toks)
    pos = np.arange(T, dtype=np.float64)
    i = np.arange(hd // 2)
    theta = pos[:, None] * base ** (-2.0 * i / hd)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g

    def rope(x):  # (T, heads, hd): rotate adjacent pairs (2i, 2i+1)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        y = np.empty_like(x)
        y[..., 0::2] = x0 * cos - x1 * sin
        y[..., 1::2] = x0 * sin + x1 * cos
        return y

    mask = np.triu(np.full((T, T), -np.inf), 1)
    x = emb[toks]
    for l in range(L):
        p = f"blk.{l}."
        h = rms(x, w[p + "attn_norm.weight"])
        q = rope((h @ w[p + "attn_q.weight"].T).reshape(T, H, hd))
        k = rope((h @ w[p + "attn_k.weight"].T).reshape(T, HKV, hd))
        v = (h @ w[p + "attn_v.weight"].T).reshape(T, HKV, hd)
        o = np.empty((T, H, hd))
        for hh in range(H):
            g = hh // (H // HKV)
            s = q[:, hh] @ k[:, g].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            o[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, g]
        x = x + o.reshape(T, -1) @ w[p + "attn_output.weight"].T
        h = rms(x, w[p + "ffn_norm.weight"])
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
    return out_w @ rms(x[-1], w["output_norm.weight"])


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else "models/SmolLM2-135M-Instruct.Q4_1.gguf"
    data = Path(__file__).resolve().parent.parent / "tests" / "data"
    w, hp = load(model)
    out = []
    for rec in (data / "smollm2-logits.txt").read_text().strip().split("\n\n"):
        d = dict(line.split(" ", 1) for line in rec.strip().split("\n"))
        logits = forward(w, hp, [int(t) for t in d["tokens"].split()])
        top = np.argsort(-logits)[:10]
        lse = logits.max() + np.log(np.exp(logits - logits.max()).sum())
        out.append(f"name {d['name']}\nexact_top10 " + " ".join(f"{i}:{logits[i]:.4f}" for i in top) +
                   f"\nexact_logsumexp {lse:.4f}\n")
        print(d["name"], "done", flush=True)
    (data / "smollm2-exact.txt").write_text("\n".join(out))


if __name__ == "__main__":
    main()
