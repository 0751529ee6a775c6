#!/usr/bin/env python3
"""Merges `tierkv eval --out` files of one protocol into one file.

    python3 scripts/eval-merge.py OUT.json IN1.json IN2.json ...

The inputs are runs of the same model, context, seed and generation cap over
disjoint sample ranges (`--first-sample`) or different tasks, policies or
budgets -- e.g. several processes sharing one GPU. Each (task, policy,
budget) cell of the output is the exact union of the inputs' cells: the score
is weighted by samples, kl and top1 by answer steps, mass_kept and the
kv_read shares by the samples that measured them, as `tierkv eval` itself
averages. Refuses inputs of different protocols and overlapping sample
ranges of the same cell. Partial inputs (a run stopped early: "complete":
false) count with the samples they finished; the output says so.
"""
import json
import sys

PROTOCOL = ("model_name", "ctx", "seed", "max_gen", "device")


def fail(msg):
    sys.exit(f"eval-merge: {msg}")


def main():
    if len(sys.argv) < 3:
        fail("usage: eval-merge.py OUT.json IN.json [IN.json ...]")
    out_path, ins = sys.argv[1], sys.argv[2:]
    runs = [(p, json.load(open(p))) for p in ins]
    base = runs[0][1]
    for p, d in runs[1:]:
        for k in PROTOCOL:
            if d.get(k) != base.get(k):
                fail(f"{p}: {k} is {d.get(k)!r}, {ins[0]} has {base.get(k)!r}")
    cells, order, ranges = {}, [], {}
    tasks = {}
    for p, d in runs:
        first = d.get("first_sample", 0)
        for t in d["tasks"]:
            a = tasks.setdefault(t["task"], dict(t, samples=0, wall_s=0.0, _sums={}))
            n = t["samples"]
            for k in ("prompt_tokens_mean", "haystack_mean", "full_answer_tokens_mean", "full_score"):
                if t.get(k) is not None:
                    a["_sums"][k] = a["_sums"].get(k, 0.0) + t[k] * n
            a["samples"] += n
            a["wall_s"] += t["wall_s"]
        for r in d["results"]:
            key = (r["task"], r["policy"], r["budget"])
            span = (first, first + r["samples"])
            for s in ranges.get(key, []):
                if span[0] < s[1] and s[0] < span[1]:
                    fail(f"{p}: samples {span[0]}..{span[1] - 1} of {key} overlap another input's {s[0]}..{s[1] - 1}")
            ranges.setdefault(key, []).append(span)
            if key not in cells:
                order.append(key)
                cells[key] = {"n": 0, "steps": 0, "mass_n": 0, "score": 0.0, "kl": 0.0, "top1": 0.0,
                              "mass_kept": 0.0, "kv_read": 0.0, "kv_read_blocks": 0.0, "policy_s": 0.0,
                              "free_runs": 0, "own_prefills": 0, "errors": []}
            c = cells[key]
            if r.get("error"):
                c["errors"].append(r["error"])
            n, steps, mn = r["samples"], r.get("answer_steps", 0), r.get("mass_samples", r["samples"])
            if n == 0 or r.get("score") is None:
                continue
            c["n"] += n
            c["steps"] += steps
            c["mass_n"] += mn
            c["score"] += r["score"] * n
            c["kl"] += r["kl"] * steps
            c["top1"] += r["top1"] * steps
            for k in ("mass_kept", "kv_read", "kv_read_blocks"):
                c[k] += r[k] * mn
            c["policy_s"] += r.get("policy_s", 0.0)
            c["free_runs"] += r.get("free_runs", 0)
            c["own_prefills"] += r.get("own_prefills", 0)
    out = {k: base[k] for k in ("tool", "version", "model", "model_name", "ctx", "seed", "max_gen", "device")
           if k in base}
    out["merged_from"] = ins
    out["complete"] = all(d.get("complete", True) for _, d in runs)
    out["wall_s"] = sum(d["wall_s"] for _, d in runs)
    out["tasks"] = []
    for name, a in tasks.items():
        n = a["samples"] or 1
        t = {k: v for k, v in a.items() if k != "_sums"}
        for k, v in a["_sums"].items():
            t[k] = v / n
        out["tasks"].append(t)
    out["results"] = []
    for key in order:
        c = cells[key]
        n, steps, mn = c["n"], c["steps"], c["mass_n"]
        r = {"task": key[0], "policy": key[1], "budget": key[2], "ctx": base["ctx"], "samples": n,
             "score": c["score"] / n if n else None,
             "kl": (c["kl"] / steps if steps else 0.0) if n else None,
             "top1": (c["top1"] / steps if steps else 1.0) if n else None}
        for k in ("mass_kept", "kv_read", "kv_read_blocks"):
            r[k] = (c[k] / mn if mn else 1.0) if n else None
        r.update({"answer_steps": steps, "mass_samples": mn, "policy_s": round(c["policy_s"], 3),
                  "free_runs": c["free_runs"], "own_prefills": c["own_prefills"]})
        if c["errors"]:
            r["error"] = c["errors"][0]
        out["results"].append(r)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    counts = sorted({r["samples"] for r in out["results"]})
    print(f"eval-merge: {len(ins)} files, {len(out['results'])} cells, samples per cell {counts}, "
          f"complete={out['complete']} -> {out_path}")


if __name__ == "__main__":
    main()
