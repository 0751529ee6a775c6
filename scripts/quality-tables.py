#!/usr/bin/env python3
"""Markdown tables for docs/quality.md from `tierkv eval --out` JSON files.

    python3 scripts/quality-tables.py docs/quality/eval-2k.json docs/quality/eval-4k.json

For each file: one table per metric (score, kl, top1, mass_kept) with a row
per policy and a column per budget, averaged over the tasks, then the score
per task. Also the gap of `entropy` to snapkv/adakv and to full per budget.
"""
import json
import sys
from collections import defaultdict


def table(title, rows, budgets, fmt):
    out = [f"**{title}**", "", "| policy | " + " | ".join(str(b) for b in budgets) + " |",
           "|---|" + "---:|" * len(budgets)]
    for pol, vals in rows.items():
        out.append(f"| {pol} | " + " | ".join(fmt(vals.get(b)) for b in budgets) + " |")
    return "\n".join(out) + "\n"


def main():
    for path in sys.argv[1:]:
        d = json.load(open(path))
        res = [r for r in d["results"] if r.get("score") is not None]
        budgets = sorted({r["budget"] for r in res})
        tasks = sorted({r["task"] for r in res})
        policies = list(dict.fromkeys(r["policy"] for r in res))
        ctx, samples = res[0]["ctx"], res[0]["samples"]
        print(f"### {ctx} tokens, {samples} samples per task ({', '.join(tasks)}); `{path}`\n")
        for metric, fmt in (("score", lambda v: "-" if v is None else f"{100 * v:.1f}"),
                            ("kl", lambda v: "-" if v is None else f"{v:.4f}"),
                            ("top1", lambda v: "-" if v is None else f"{100 * v:.1f}"),
                            ("mass_kept", lambda v: "-" if v is None else f"{100 * v:.1f}")):
            acc = defaultdict(lambda: defaultdict(list))
            for r in res:
                acc[r["policy"]][r["budget"]].append(r[metric])
            rows = {p: {b: sum(v) / len(v) for b, v in acc[p].items()} for p in policies}
            unit = {"score": " (RULER score x100, mean over tasks)", "kl": " (mean next-token KL vs full, nats)",
                    "top1": " (% top-1 agreement with full)", "mass_kept": " (% of full attention mass kept)"}[metric]
            print(table(metric + unit, rows, budgets, fmt))
        for t in tasks:
            rows = {p: {r["budget"]: r["score"] for r in res if r["task"] == t and r["policy"] == p} for p in policies}
            print(table(f"score x100, {t}", rows, budgets, lambda v: "-" if v is None else f"{100 * v:.1f}"))
        # targets
        mean = defaultdict(dict)
        for p in policies:
            for b in budgets:
                v = [r["score"] for r in res if r["policy"] == p and r["budget"] == b]
                if v:
                    mean[p][b] = 100 * sum(v) / len(v)
        if "entropy" in mean:
            print("| budget | entropy | snapkv | adakv | full | entropy - max(snapkv, adakv) | entropy - full |")
            print("|---:|---:|---:|---:|---:|---:|---:|")
            for b in budgets:
                e, s, a, f = (mean.get(p, {}).get(b) for p in ("entropy", "snapkv", "adakv", "full"))
                best = max(x for x in (s, a) if x is not None) if (s is not None or a is not None) else None
                print(f"| {b} | {e:.1f} | {s if s is None else f'{s:.1f}'} | {a if a is None else f'{a:.1f}'} | "
                      f"{f if f is None else f'{f:.1f}'} | {'-' if best is None else f'{e - best:+.1f}'} | "
                      f"{'-' if f is None else f'{e - f:+.1f}'} |")
            print()


if __name__ == "__main__":
    main()
