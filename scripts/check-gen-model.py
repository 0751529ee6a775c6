#!/usr/bin/env python3
"""check-gen-model.py -- does llama.cpp load what `tierkv gen-model` writes?

For each model given (or, with none, a tiny and a custom one generated here
in every type), llama.cpp (llama-cpp-python) loads the file, tokenizes a text,
evaluates it and decodes greedily. Printed per model: llama.cpp's
tokenization vs `tierkv tokenize`, logit statistics (all finite, spread),
and llama.cpp's greedy continuation vs `tierkv run --temp 0`. Exit 1 if
llama.cpp fails to load a model, a logit is not finite, or the tokenizations
differ. Not part of CI (needs llama-cpp-python):

    /work/venv-ref/bin/python scripts/check-gen-model.py [--tierkv build/tierkv] [MODEL.gguf ...]
"""
import argparse
import math
import os
import subprocess
import sys
import tempfile

TEXT = "hello world, the quick brown fox jumps over the lazy dog. 1234 tokens!"


def tierkv_tokenize(tierkv, model, text):
    out = subprocess.run([tierkv, "tokenize", "-m", model, "-p", text], check=True,
                         capture_output=True, text=True).stdout
    return [int(t) for t in out.split()]


def tierkv_greedy(tierkv, model, text, n):
    return subprocess.run([tierkv, "run", "-m", model, "-p", text, "-n", str(n), "--temp", "0", "-t", "2",
                           "--ignore-eos"], check=True, capture_output=True).stdout.rstrip(b"\n")


def check(tierkv, path, deep=False):
    from llama_cpp import Llama
    import numpy as np

    ok = True
    llm = Llama(model_path=path, n_ctx=256, n_threads=2, logits_all=True, verbose=False)
    print(f"== {os.path.basename(path)}: llama.cpp loaded it: n_vocab {llm.n_vocab()}, n_embd {llm.n_embd()}, "
          f"n_ctx_train {llm._model.n_ctx_train()}")
    toks = llm.tokenize(TEXT.encode(), add_bos=False, special=False)
    ours = tierkv_tokenize(tierkv, path, TEXT)
    same = toks == ours
    ok &= same
    print(f"   tokens ({len(toks)}): {'identical to tierkv' if same else 'DIFFER from tierkv'}")
    if not same:
        print(f"     llama.cpp {toks}\n     tierkv    {ours}")
    prompt = llm.tokenize(TEXT.encode(), add_bos=True, special=False)
    llm.reset()
    llm.eval(prompt)
    logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
    finite = bool(np.all(np.isfinite(logits)))
    ok &= finite
    p = np.exp(logits - logits.max())
    p /= p.sum()
    entropy = float(-(p * np.log(p + 1e-30)).sum())
    print(f"   last logits: finite {finite}, mean {logits.mean():+.3f}, std {logits.std():.3f}, "
          f"min {logits.min():+.3f}, max {logits.max():+.3f}, softmax entropy {entropy:.2f} "
          f"(uniform {math.log(len(logits)):.2f}), argmax {int(logits.argmax())}")
    if deep:
        ok &= residual_check(path, prompt, logits)
    gen = []
    for _ in range(8):
        t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        gen.append(t)
        llm.eval([t])
    theirs = llm.detokenize(gen)
    ours_text = tierkv_greedy(tierkv, path, TEXT, 8)
    print(f"   greedy 8 tokens: llama.cpp {gen} -> {theirs!r}")
    print(f"                    tierkv    {ours_text!r} ({'same bytes' if ours_text == theirs else 'differ'})")
    return ok


def residual_check(path, text_tokens, llama_logits):
    """A numpy forward pass of the f16 model at `path`: prints the RMS of the
    residual stream after each layer and the final logits' spread, and how
    far its logits are from llama.cpp's (an independent check of both)."""
    import numpy as np
    from gguf import GGUFReader

    r = GGUFReader(path)
    kv = {f.name: f for f in r.fields.values()}
    val = lambda k: kv[k].parts[kv[k].data[0]][0]
    L, E = int(val("llama.block_count")), int(val("llama.embedding_length"))
    H, HKV = int(val("llama.attention.head_count")), int(val("llama.attention.head_count_kv"))
    base, eps = float(val("llama.rope.freq_base")), float(val("llama.attention.layer_norm_rms_epsilon"))
    hd = E // H
    T = {t.name: t for t in r.tensors}
    W = lambda n: np.asarray(T[n].data, dtype=np.float32)  # [rows, ne0]: y = x @ W.T

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rope(x):  # x [n, heads, hd]; llama.cpp's normal mode rotates adjacent pairs
        n = x.shape[0]
        inv = base ** (-np.arange(0, hd, 2) / hd)
        ang = np.arange(n)[:, None] * inv[None, :]
        c, s_ = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * c - b * s_, a * s_ + b * c
        return out

    n = len(text_tokens)
    x = W("token_embd.weight")[text_tokens]
    rms = [float(np.sqrt((x * x).mean()))]
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for l in range(L):
        p = f"blk.{l}."
        h = norm(x, W(p + "attn_norm.weight"))
        q = rope((h @ W(p + "attn_q.weight").T).reshape(n, H, hd))
        k = rope((h @ W(p + "attn_k.weight").T).reshape(n, HKV, hd))
        v = (h @ W(p + "attn_v.weight").T).reshape(n, HKV, hd)
        k, v = np.repeat(k, H // HKV, axis=1), np.repeat(v, H // HKV, axis=1)
        sc = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
        pr = np.exp(sc - sc.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", pr, v).reshape(n, E) @ W(p + "attn_output.weight").T
        h = norm(x, W(p + "ffn_norm.weight"))
        g, u = h @ W(p + "ffn_gate.weight").T, h @ W(p + "ffn_up.weight").T
        x = x + (g / (1 + np.exp(-g)) * u) @ W(p + "ffn_down.weight").T
        rms.append(float(np.sqrt((x * x).mean())))
    logits = norm(x[-1], W("output_norm.weight")) @ W("output.weight").T
    print(f"   numpy forward ({L} layers, {n} tokens): residual RMS after embedding and each layer:")
    print("     " + " ".join(f"{v:.3f}" for v in rms))
    print(f"   numpy logits: std {logits.std():.3f}, max {logits.max():+.3f}; "
          f"max |numpy - llama.cpp| = {np.abs(logits - llama_logits).max():.2e}")
    return bool(np.all(np.isfinite(logits))) and rms[-1] < 10


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tierkv", default=os.path.join(os.path.dirname(__file__), "..", "build", "tierkv"))
    ap.add_argument("models", nargs="*")
    a = ap.parse_args()
    models = list(a.models)
    tmp = None
    if not models:
        tmp = tempfile.mkdtemp(prefix="tkv-gen-check-")
        for shape in ("tiny", "custom:3,256,8,2,512,2048"):
            for ty in ("f16", "q8_0", "q4_0"):
                out = os.path.join(tmp, f"{shape.replace(':', '-').replace(',', '_')}-{ty}.gguf")
                subprocess.run([a.tierkv, "gen-model", "--shape", shape, "--type", ty, "--seed", "7",
                                "--out", out, "-t", "2"], check=True)
                models.append(out)
        # deep and narrow: the residual scaling matters with depth, not width
        out = os.path.join(tmp, "deep-f16.gguf")
        subprocess.run([a.tierkv, "gen-model", "--shape", "custom:32,512,8,2,1536,2048", "--type", "f16",
                        "--seed", "7", "--out", out, "-t", "2"], check=True)
        models.append(out)
    ok = True
    for m in models:
        try:
            ok &= check(a.tierkv, m, deep=m.endswith("f16.gguf"))
        except Exception as e:  # a load failure is the thing this script looks for
            print(f"== {m}: FAILED: {e}")
            ok = False
    if tmp:
        for m in models:
            os.unlink(m)
        os.rmdir(tmp)
    print("all good" if ok else "PROBLEMS above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
