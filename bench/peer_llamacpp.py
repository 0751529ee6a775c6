#!/usr/bin/env python3
"""Peer benchmark: llama.cpp (via llama-cpp-python) prefill and decode speed.

Run with a Python that has llama_cpp installed, e.g.

    /work/venv-ref/bin/python bench/peer_llamacpp.py \
        --model models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --ctx 512 --threads 2 --decode 32 --json out/peer.json

Prefill: an exactly --ctx token prompt (GPL-3 text, repeated/truncated at the
token level, no BOS) is evaluated in batches of n_batch=512 (llama.cpp's
default) into a fresh context.  Decode: --decode tokens after that prompt,
pure argmax, one token per llama_decode call.  Each measurement is repeated
--reps times (fresh context each time) and the best is reported.
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import llama_cpp
from llama_cpp import Llama

GPL3_PATH = "/usr/share/common-licenses/GPL-3"
N_BATCH = 512


def make_prompt(llm, n):
    with open(GPL3_PATH, "rb") as f:
        base = llm.tokenize(f.read(), add_bos=False, special=False)
    toks = []
    while len(toks) < n:
        toks.extend(base)
    return toks[:n]


def argmax_last(llm):
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))))


def one_rep(args, n_ctx):
    llm = Llama(
        model_path=args.model,
        n_ctx=n_ctx,
        n_batch=N_BATCH,
        n_ubatch=N_BATCH,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        seed=0,
        logits_all=False,
        flash_attn=False,
        verbose=False,
    )
    try:
        prompt = make_prompt(llm, args.ctx)  # not timed
        # Prefill (llm.eval splits into n_batch chunks; logits only for last).
        t0 = time.perf_counter()
        llm.eval(prompt)
        tok = argmax_last(llm)
        t1 = time.perf_counter()
        # Decode: D tokens, each one llama_decode of a single token.
        t2 = time.perf_counter()
        for _ in range(args.decode):
            llm.eval([tok])
            tok = argmax_last(llm)
        t3 = time.perf_counter()
    finally:
        llm.close()
    return len(prompt) / (t1 - t0), args.decode / (t3 - t2) if args.decode else 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--ctx", type=int, required=True, help="prompt length N in tokens")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--decode", type=int, default=32, help="decode tokens D")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", default=None, help="output JSON path")
    args = ap.parse_args()

    n_ctx = args.ctx + args.decode + 16
    best_pf = best_dec = 0.0
    for r in range(args.reps):
        pf, dec = one_rep(args, n_ctx)
        print(f"rep {r}: prefill {pf:.1f} tok/s, decode {dec:.1f} tok/s", file=sys.stderr)
        best_pf = max(best_pf, pf)
        best_dec = max(best_dec, dec)

    res = {
        "impl": "llama.cpp",
        "version": "llama-cpp-python " + llama_cpp.__version__,
        "ctx": args.ctx,
        "decode": args.decode,
        "threads": args.threads,
        "n_batch": N_BATCH,
        "reps": args.reps,
        "prefill_tok_s": round(best_pf, 2),
        "decode_tok_s": round(best_dec, 2),
    }
    out = json.dumps(res, indent=2)
    print(out)
    if args.json:
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        with open(args.json, "w") as f:
            f.write(out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
