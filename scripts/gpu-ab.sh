#!/bin/bash
# gpu-ab.sh -- alternate bench-decode builds (or one build under several
# environments) in one device call and print one line a row, so a change is
# judged against main side by side on the same warm GPU (docs/gpu.md,
# "Running on the H200"; docs/benchmarks.md's session sections were measured
# this way).
#
#   scripts/gpu-ab.sh [-r ROUNDS] [-c CTX] [-s STEPS] [-m MODEL] [-o OUTDIR] VARIANT...
#
# VARIANT is TAG=BENCH_DECODE[:VAR=VAL[,VAR=VAL...]], e.g.
#   main=/tmp/b/main/bench-decode  new=/tmp/b/new/bench-decode  off=/tmp/b/new/bench-decode:TKV_X=0
# Each round runs every variant once, in the order given. Defaults: 2 rounds,
# --ctx 4096,32768, 32 steps, MODEL /tmp/l8-q4_0.gguf (made with the first
# variant's tierkv, beside its bench-decode, when missing: llama3-8b Q4_0,
# seed 1). DEVICE (default cuda) and THREADS (default 16) come from the
# environment; each run's log goes to OUTDIR (default $OUT, else /tmp).
# Prints "TAG | ctx | mean ms | median ms | x roofline | wait ms" lines;
# a variant whose run failed prints "TAG | failed (rc N): LOG".
set -u
usage() { awk 'NR == 1 { next } /^#/ { print; next } { exit }' "$0"; exit 2; } # the comment block above
rounds=2 ctx=4096,32768 steps=32 model=/tmp/l8-q4_0.gguf outdir=${OUT:-/tmp}
while getopts r:c:s:m:o: opt; do
    case $opt in
    r) rounds=$OPTARG ;;
    c) ctx=$OPTARG ;;
    s) steps=$OPTARG ;;
    m) model=$OPTARG ;;
    o) outdir=$OPTARG ;;
    *) usage ;;
    esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || usage
# the variants, split once: tags[i], bins[i], envs[i] (VAR=VAL words)
tags=() bins=() envs=()
for v in "$@"; do
    [[ $v == *=* ]] || { echo "gpu-ab: $v: want TAG=BENCH_DECODE[:VAR=VAL,...]" >&2; exit 2; }
    rest=${v#*=}
    bin=${rest%%:*} env_list=
    [[ $rest == *:* ]] && env_list=${rest#*:}
    [ -x "$bin" ] || { echo "gpu-ab: $bin: not an executable" >&2; exit 2; }
    tags+=("${v%%=*}") bins+=("$bin") envs+=("${env_list//,/ }")
done
device=${DEVICE:-cuda} threads=${THREADS:-16}
mkdir -p "$outdir"
if [ ! -f "$model" ]; then
    gen=$(dirname "${bins[0]}")/tierkv
    [ -x "$gen" ] || { echo "gpu-ab: $model is missing and there is no $gen to make it" >&2; exit 2; }
    "$gen" gen-model --shape llama3-8b --type q4_0 --seed 1 --out "$model" -t "$threads" > "$outdir/gen-model.log" 2>&1 ||
        { echo "gpu-ab: gen-model failed: $outdir/gen-model.log" >&2; exit 1; }
fi
echo "# tag | ctx | mean ms | median ms | x roofline | wait ms  ($device, $(basename "$model"), $steps steps)"
for ((r = 1; r <= rounds; r++)); do
    for i in "${!tags[@]}"; do
        tag=${tags[i]}
        log=$outdir/ab.$tag.$r.log
        # shellcheck disable=SC2086 # envs[i] splits into env's VAR=VAL arguments
        env ${envs[i]} "${bins[i]}" -m "$model" --device "$device" --fill synthetic -t "$threads" --steps "$steps" \
            --ctx "$ctx" > "$log" 2>&1
        rc=$?
        if [ $rc -ne 0 ]; then
            echo "$tag | failed (rc $rc): $log"
            continue
        fi
        # bench-decode's table, its columns found by their headers (a
        # quantized model on the GPU adds "ratio, f16 matrices")
        awk -F'|' -v t="$tag" '
            function trim(s) { gsub(/^ +| +$/, "", s); return s }
            !/^\| / { next }
            /^\| model/ { for (i = 2; i < NF; i++) col[trim($i)] = i; next }
            /^\|---/ { next }
            { printf "%s | %s | %s | %s | %s | %s\n", t, trim($col["ctx"]), trim($col["step ms (mean)"]),
                     trim($col["step ms (median)"]), trim($col["ratio"]), trim($col["wait ms"]) }' "$log"
    done
done
