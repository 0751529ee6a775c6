#!/bin/bash
# gpu-eval.sh -- the docs/quality.md sweep on one GPU, many processes at once.
#
#   scripts/gpu-eval.sh TIERKV MODEL CTX SAMPLES CHUNK OUTDIR [SET]
#
# Runs `tierkv eval --device cuda` over the four tasks of docs/quality.md,
# split into one process per (task, CHUNK samples): SmolLM2-135M keeps a GPU
# busy only a fraction of the time, so processes sharing it finish the sweep
# several times sooner. Each process writes its JSON after every sample
# (tierkv eval --first-sample), so a run cut short keeps what it finished;
# scripts/eval-merge.py then joins the pieces into OUTDIR/eval-CTX[-SET].json.
#
# SET: policies (default) -- every policy of the issue at budgets 64..1024;
#      rabitq             -- full, rabitq at p = 0.9 and 0.95, entropy+rabitq
#                            (their own defaults: budget 0).
# Environment: EVAL_TIMEOUT (seconds per process, default 540), EVAL_TASKS,
# EVAL_DEVICE (default cuda; cpu for a dry run).
set -uo pipefail
[ $# -ge 6 ] || { sed -n '2,17p' "$0"; exit 2; }
tierkv=$1 model=$2 ctx=$3 samples=$4 chunk=$5 out=$6 set=${7:-policies}
root=$(cd "$(dirname "$0")/.." && pwd)
tasks=${EVAL_TASKS:-niah_single,niah_multikey,vt,fwe}
case "$set" in
policies) pol='full,streaming,snapkv,adakv,critiprefill,entropy:faithful=1,entropy'; bud=64,128,256,512,1024; tag= ;;
rabitq) pol='full,rabitq:p=0.9,rabitq:p=0.95,entropy+rabitq'; bud=0; tag=-rabitq ;;
*) echo "gpu-eval: unknown set '$set'" >&2; exit 2 ;;
esac
mkdir -p "$out/parts$tag-$ctx"
t0=$(date +%s)
pids=()
for task in ${tasks//,/ }; do
    for ((first = 0; first < samples; first += chunk)); do
        n=$((samples - first < chunk ? samples - first : chunk))
        part="$out/parts$tag-$ctx/$task-$first"
        timeout "${EVAL_TIMEOUT:-540}" "$tierkv" eval -m "$model" --device "${EVAL_DEVICE:-cuda}" --task "$task" --ctx "$ctx" \
            --samples "$n" --first-sample "$first" --seed 42 --policy "$pol" --budget "$bud" --keep-going -t 1 \
            --out "$part.json" > "$part.log" 2>&1 &
        pids+=($!)
    done
done
echo "gpu-eval: ${#pids[@]} processes, ctx $ctx, $samples samples per task, set $set"
fails=0
for p in "${pids[@]}"; do wait "$p" || fails=$((fails + 1)); done
echo "gpu-eval: done in $(( $(date +%s) - t0 )) s, $fails processes failed or were cut short"
grep -h "policy '.*' (budget" "$out/parts$tag-$ctx"/*.log | sort | uniq -c | head -20
ls "$out/parts$tag-$ctx"/*.json > /dev/null 2>&1 &&
    python3 "$root/scripts/eval-merge.py" "$out/eval-$ctx$tag.json" "$out/parts$tag-$ctx"/*.json
