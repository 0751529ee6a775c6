#!/usr/bin/env python3
"""`tierkv eval --first-sample` + scripts/eval-merge.py: two runs over
disjoint sample ranges merge into exactly the run over both ranges.

Runs the command three times on the real model (512-token passkey prompts,
two policies); skips (77) without the model or the binary."""
import json
import os
import subprocess
import sys
import tempfile

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
model = os.environ.get("TKV_MODEL", "")
tierkv = os.path.join(os.environ.get("TKV_BUILD_DIR", "."), "tierkv")
if not os.path.exists(model) or not os.access(tierkv, os.X_OK):
    print(f"SKIP: model ({model}) or tierkv ({tierkv}) missing")
    sys.exit(77)

failures = 0


def check(ok, msg):
    global failures
    if not ok:
        failures += 1
        print("FAIL:", msg)


def run(out, *extra):
    cmd = [tierkv, "eval", "-m", model, "--task", "passkey,niah_single", "--ctx", "512", "--policy", "full,streaming,snapkv",
           "--budget", "64", "--max-gen", "8", "-t", "2", "--out", out, *extra]
    p = subprocess.run(cmd, capture_output=True, text=True)
    check(p.returncode == 0, f"{' '.join(cmd)}: exit {p.returncode}: {p.stderr[-2000:]}")
    check(not os.path.exists(out + ".part"), f"{out}.part left behind")
    return json.load(open(out))


with tempfile.TemporaryDirectory() as d:
    both = run(f"{d}/both.json", "--samples", "2")
    a = run(f"{d}/a.json", "--samples", "1")
    b = run(f"{d}/b.json", "--samples", "1", "--first-sample", "1")
    check(both["complete"] and a["complete"] and b["complete"], "complete runs say so")
    check(b["first_sample"] == 1, f"first_sample {b['first_sample']}")
    m = subprocess.run([sys.executable, f"{root}/scripts/eval-merge.py", f"{d}/m.json", f"{d}/a.json", f"{d}/b.json"],
                       capture_output=True, text=True)
    check(m.returncode == 0, f"merge: {m.stderr}")
    merged = json.load(open(f"{d}/m.json"))
    key = lambda r: (r["task"], r["policy"], r["budget"])
    want = {key(r): r for r in both["results"]}
    got = {key(r): r for r in merged["results"]}
    check(set(want) == set(got) and len(want) == 6, f"cells {sorted(got)} vs {sorted(want)}")
    for k, w in want.items():
        g = got.get(k, {})
        for f in ("samples", "answer_steps", "mass_samples"):
            check(g.get(f) == w[f], f"{k} {f}: {g.get(f)} vs {w[f]}")
        for f in ("score", "kl", "top1", "mass_kept", "kv_read", "kv_read_blocks"):
            gv, wv = g.get(f), w[f]
            check(gv is not None and abs(gv - wv) <= 1e-5 * max(1.0, abs(wv)), f"{k} {f}: merged {gv} vs one run {wv}")
    # the two halves differ (otherwise the merge proves nothing)
    check(any(ra["score"] != rb["score"] or ra["kl"] != rb["kl"] for ra, rb in zip(a["results"], b["results"])) or
          a["tasks"][0]["prompt_tokens_mean"] != b["tasks"][0]["prompt_tokens_mean"], "the two samples are not distinct")
    # the same range twice is refused
    m = subprocess.run([sys.executable, f"{root}/scripts/eval-merge.py", f"{d}/m2.json", f"{d}/a.json", f"{d}/a.json"],
                       capture_output=True, text=True)
    check(m.returncode != 0 and "overlap" in m.stderr, f"overlapping ranges accepted: {m.returncode} {m.stderr}")

print(f"eval-merge: {failures} failures")
sys.exit(1 if failures else 0)
