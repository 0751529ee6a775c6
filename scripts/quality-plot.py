#!/usr/bin/env python3
"""Score vs KV budget from a `tierkv eval` JSON (one run, or scripts/eval-merge.py's output).

    python3 scripts/quality-plot.py docs/quality/eval-4k.json docs/quality/eval-4k.png

One panel per task and one for the mean over tasks, one line per policy
(x: tokens kept per KV head, log scale); a policy run only at budget 0 (its
own default, e.g. rabitq's top-p) is a horizontal dashed line. Needs gnuplot
(apt-get install gnuplot-nox). `tierkv eval --plot` draws the same panels
for a single run straight from its results.
"""
import json
import math
import subprocess
import sys
from collections import defaultdict


def gp(s):
    return "'" + s.replace("'", "''") + "'"


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: quality-plot.py EVAL.json OUT.png")
    d = json.load(open(sys.argv[1]))
    res = [r for r in d["results"] if r.get("score") is not None]
    tasks = sorted({r["task"] for r in res})
    policies = list(dict.fromkeys(r["policy"] for r in res))
    budgets = sorted({r["budget"] for r in res if r["budget"] > 0})
    if not budgets:
        sys.exit("quality-plot: no budgets > 0 to put on the x axis")
    score = defaultdict(dict)  # (panel, policy) -> {budget: score}
    for r in res:
        score[(r["task"], r["policy"])][r["budget"]] = r["score"]
    for p in policies:
        for b in {r["budget"] for r in res if r["policy"] == p}:
            v = [score[(t, p)][b] for t in tasks if b in score[(t, p)]]
            if len(v) == len(tasks):
                score[("mean over tasks", p)][b] = sum(v) / len(v)
    panels = tasks + ["mean over tasks"]
    cols = math.ceil(math.sqrt(len(panels)))
    rows = math.ceil(len(panels) / cols)
    lo, hi = budgets[0] / 1.4, budgets[-1] * 1.4
    n = min(r["samples"] for r in res)
    title = f"{d.get('model_name', 'model')}, ctx {d['ctx']}, {n} samples per task, device {d.get('device', '?')}"
    out = [f"set terminal pngcairo size {560 * cols},{380 * rows + 40} noenhanced",
           f"set output {gp(sys.argv[2])}", "set grid", "set key bottom right font ',9'", "set yrange [0:1.05]",
           f"set xrange [{lo}:{hi}]", "set logscale x 2", "set xlabel 'KV budget (tokens per KV head)'",
           "set ylabel 'score'",
           f"set multiplot layout {rows},{cols} title {gp(title)}"]
    data = []  # gnuplot data blocks, defined before the multiplot
    for panel in panels:
        out.append(f"set title {gp(panel)}")
        terms = []
        for i, p in enumerate(policies):
            pts = score.get((panel, p), {})
            if not pts:
                continue
            if set(pts) == {0}:  # the policy's own budget: a level line
                xs = [(lo, pts[0]), (hi, pts[0])]
                style = f"with lines lw 2 dt 2 lc {i + 1}"
            else:
                xs = sorted((b, v) for b, v in pts.items() if b > 0)
                style = f"with linespoints lw 2 ps 1.2 pt {(7, 5, 9, 11, 13, 4, 6, 8, 10, 12)[i % 10]} lc {i + 1}"
            name = f"$d{len(data)}"
            data.append(f"{name} << EOD\n" + "".join(f"{x} {y}\n" for x, y in xs) + "EOD")
            terms.append(f"{name} using 1:2 {style} title {gp(p)}")
        out.append("plot " + ", ".join(terms))
    out = data + out + ["unset multiplot"]
    r = subprocess.run(["gnuplot"], input="\n".join(out) + "\n", text=True, capture_output=True)
    if r.returncode != 0:
        sys.exit(f"quality-plot: gnuplot failed: {r.stderr}")
    print(f"quality-plot: {sys.argv[2]} ({len(panels)} panels, {len(policies)} policies)")


if __name__ == "__main__":
    main()
