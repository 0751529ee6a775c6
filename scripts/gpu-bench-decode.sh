#!/bin/bash
# gpu-bench-decode.sh -- end-to-end decode of the synthetic llama3-8b (f16 and
# q4_0) at 4K/32K/128K tokens of context on the GPU machine, against the
# roofline measured in the same run (bench/bench-decode.c, docs/bench-decode.md).
#
# On the device, from the root of a snapshot of the tree (scripts/gpu-run.sh
# snap here, then carry .device and .gpu-snap):
#   source .device/bootstrap.sh && bash .gpu-snap/scripts/gpu-bench-decode.sh
# It uses the build at /tmp/tkv-build (configures one from the snapshot if
# there is none; builds only bench-decode and tierkv), writes the models to
# /tmp/tkv-llama3-8b-f16.gguf and /tmp/tkv-llama3-8b-q4_0.gguf (kept: a later call on a warm machine
# reuses them) and the logs and JSON lines to $OUT.
#
# Order (each step bounded by what is left of BUDGET_S, default 450 s):
#   1. gen-model llama3-8b f16 and q4_0, -t 16 (~5-8 s each on the H200 host)
#   2. synthetic fill at 4K, 32K, 128K, both models: the table that matters
#      (a 512-token real prefill, the rest of the KV copies of its blocks;
#      ~10 s to fill 128K: 0.5M block imports)
#   3. real prefill at 4K (both) and 32K (f16): the cross-check that the
#      synthetic fill gives the same step time
# Overrides for a trial run elsewhere: TKV_BUILD (build dir), SHAPE (gen-model
# shape), CTX (the synthetic contexts), PREFILL_CTX (the f16 cross-check's),
# DEVICE; e.g. on the CPU build machine:
#   TKV_BUILD=build/release SHAPE=tiny CTX=512,2048 PREFILL_CTX=512,2048 DEVICE=cpu \
#       OUT=/tmp/bd scripts/gpu-bench-decode.sh
# Memory: 16 GB of f16 weights on the GPU for either file (q4_0 is dequantized
# at load) + 16 GiB of f16 KV at 128K + 2 GiB for the bandwidth test (freed
# before the sessions): ~35 GB of the H200's 139 GiB. Disk: 16 + 4.5 GB in /tmp.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${TKV_BUILD:-/tmp/tkv-build}
SHAPE=${SHAPE:-llama3-8b}
CTX=${CTX:-4096,32768,131072}
PREFILL_CTX=${PREFILL_CTX:-4096,32768}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-/tmp/bench-decode-out}
BUDGET_S=${BUDGET_S:-450}
mkdir -p "$OUT"
t_start=$(date +%s)
left() { echo $((BUDGET_S - ($(date +%s) - t_start))); }
log() { echo "[$(($(date +%s) - t_start)) s] $*" | tee -a "$OUT/steps.log"; }

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,memory.total,driver_version \
    --format=csv > "$OUT/gpu.csv" 2>&1 || true
cat "$OUT/gpu.csv"

if [ ! -f "$build/CMakeCache.txt" ]; then
    log "configuring $build from $root"
    cmake -B "$build" -S "$root" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 > "$OUT/cmake.log" 2>&1 ||
        { tail -20 "$OUT/cmake.log"; exit 1; }
fi
log "building bench-decode and tierkv"
cmake --build "$build" -j"$(nproc)" --target bench-decode tierkv > "$OUT/build.log" 2>&1 ||
    { grep -E "error|Error" "$OUT/build.log" | head -20; exit 1; }
bd="$build/bench/bench-decode"

for type in f16 q4_0; do
    model=/tmp/tkv-$SHAPE-$type.gguf
    if [ ! -f "$model" ]; then
        log "gen-model $SHAPE $type"
        "$build/tierkv" gen-model --shape "$SHAPE" --type "$type" --seed 1 --out "$model" -t 16 \
            2>&1 | tee -a "$OUT/gen-model.log" || { log "gen-model $type failed"; exit 1; }
    fi
done

# run NAME TIMEOUT ARGS...: one bench-decode call, if the budget allows
run() {
    local name=$1 limit=$2
    shift 2
    local l
    l=$(left)
    if [ "$l" -lt 30 ]; then
        log "skipped $name: $l s left"
        return 0
    fi
    [ "$limit" -gt "$l" ] && limit=$l
    log "bench-decode $name (limit $limit s): $*"
    timeout "$limit" "$bd" "$@" -j "$OUT/$name.jsonl" > "$OUT/$name.md" 2> "$OUT/$name.err"
    local rc=$?
    cat "$OUT/$name.md"
    [ -s "$OUT/$name.err" ] && tail -5 "$OUT/$name.err"
    log "$name: exit $rc"
}

for type in f16 q4_0; do
    run "synthetic-$type" 150 -m "/tmp/tkv-$SHAPE-$type.gguf" --device "$DEVICE" --ctx "$CTX" --fill synthetic --steps 32
done
run "prefill-f16" 120 -m "/tmp/tkv-$SHAPE-f16.gguf" --device "$DEVICE" --ctx "$PREFILL_CTX" --fill prefill --steps 32
run "prefill-q4_0" 60 -m "/tmp/tkv-$SHAPE-q4_0.gguf" --device "$DEVICE" --ctx "${PREFILL_CTX%%,*}" --fill prefill \
    --steps 32

cat "$OUT"/synthetic-*.jsonl "$OUT"/prefill-*.jsonl > "$OUT/bench-decode.jsonl" 2>/dev/null || true
log "done; $(wc -l < "$OUT/bench-decode.jsonl") rows in $OUT/bench-decode.jsonl"
