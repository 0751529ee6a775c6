#!/bin/bash
# gpu-bench-recall.sh -- issue 6, item 7 on the H200: decode tok/s with the GPU
# KV capped (8G), the rest in pinned host memory (and NVMe at 1M), with the
# rabitq policy recalling what each step reads, beside `full` with all KV on
# the GPU; per-step split and PCIe use (bench/bench-recall.c,
# docs/bench-decode.md, "Recall under tier caps").
#
#   bash scripts/gpu-bench-recall.sh PIECE      (from the root of the tree)
#
# One piece per call, each bounded by BUDGET_S (default 450 s) so that a call
# stays under 8 minutes; the build and the models in /tmp are kept for the
# next call on a warm machine (a cold machine rebuilds and regenerates them).
#   build          configure /tmp/tkv-build if needed, build bench-recall and
#                  tierkv, generate llama3-8b f16 and q4_0 (~7 s each, -t 16)
#   l8-f16         llama3-8b f16 at 32K and 128K: full, rabitq:p=0.9 (safe
#                  top-p, the policy's default), rabitq:p=0.9,safe=0
#   l8-q4_0        the same with q4_0 weights
#   l8-512k-f16    llama3-8b f16 at 512K: full, rabitq:p=0.9,safe=0
#                  (GPU 8G + host 72G: the 64 GiB of KV fit without NVMe; the
#                  host tier keeps clean copies of blocks also on the GPU, so
#                  it must hold about the whole KV: 60G ran out, 2026-12-03)
#   l8-512k-q4_0   the same with q4_0
#   qwen-128k      qwen2.5-7b shape (28 layers, 4 KV heads) q4_0 at 128K:
#                  full and rabitq:p=0.9,safe=0 (the 1M row's reference)
#   qwen-1m        the same at 1M (56 GiB of KV: GPU 8G, host 40G, the rest
#                  NVMe in /tmp); generates the model (--ctx 1048576) if needed
#   l8-hetero      llama3-8b q4_0 at 128K: full without caps, then under the
#                  caps rabitq:p=0.9,safe=0 with --hetero auto, recall and
#                  cpu, after 2 and after 24 warm-up steps (how auto's
#                  choice compares with both paths)
# Every context is made by the synthetic fill (512 real tokens, the rest
# copies with concentrated attention: hot 1/64 + last 2 blocks at 4 nats,
# cold 0.25 nats); rows say "synthetic" and print the share of KV each step
# read. Logs, tables (*.md) and JSON lines (*.jsonl) go to $OUT.
#
# Overrides for a trial run elsewhere: TKV_BUILD, TKV_BIN (a folder holding
# prebuilt bench-recall and tierkv, e.g. sm_90 binaries built on the CPU
# machine and carried: nothing is configured or built), DEVICE, L8_SHAPE, QW_SHAPE,
# CTX_SHORT (default 32768,131072), CTX_512K, CTX_128K, CTX_1M, GPU_KV, HOST_KV_512K,
# HOST_KV_1M, NVME_DIR, STEPS_SHORT/STEPS_LONG ("warmup,steps,split"), BR_ARGS (more
# bench-recall options for every row, e.g. --forced for A/B runs), e.g. on
# the CPU build machine:
#   TKV_BUILD=build/rel DEVICE=cpu L8_SHAPE=custom:4,1024,8,2,2816,2048 CTX_SHORT=4096 \
#       GPU_KV=16M OUT=/tmp/br bash scripts/gpu-bench-recall.sh l8-f16
# (on the CPU the compute tier is host memory: GPU_KV then caps it through
# --host-kv-mem and the rest goes to NVMe).
set -uo pipefail
piece=${1:-}
root=$(cd "$(dirname "$0")/.." && pwd)
build=${TKV_BUILD:-/tmp/tkv-build}
DEVICE=${DEVICE:-cuda}
L8_SHAPE=${L8_SHAPE:-llama3-8b}
QW_SHAPE=${QW_SHAPE:-qwen2.5-7b}
CTX_SHORT=${CTX_SHORT:-32768,131072}
CTX_512K=${CTX_512K:-524288}
CTX_128K=${CTX_128K:-131072}
CTX_1M=${CTX_1M:-1048576}
GPU_KV=${GPU_KV:-8G}
HOST_KV_512K=${HOST_KV_512K:-72G}
HOST_KV_1M=${HOST_KV_1M:-40G}
NVME_DIR=${NVME_DIR:-/tmp/tkv-recall-nvme}
STEPS_SHORT=${STEPS_SHORT:-2,8,4}
STEPS_LONG=${STEPS_LONG:-2,3,2}
OUT=${OUT:-/tmp/bench-recall-out}
BUDGET_S=${BUDGET_S:-450}
mkdir -p "$OUT" "$NVME_DIR"
t_start=$(date +%s)
left() { echo $((BUDGET_S - ($(date +%s) - t_start))); }
log() { echo "[$(($(date +%s) - t_start)) s] $*" | tee -a "$OUT/steps.log"; }

case "$piece" in
build | l8-f16 | l8-q4_0 | l8-512k-f16 | l8-512k-q4_0 | qwen-128k | qwen-1m | l8-hetero) ;;
*)
    echo "usage: $0 build|l8-f16|l8-q4_0|l8-512k-f16|l8-512k-q4_0|qwen-128k|qwen-1m|l8-hetero" >&2
    exit 2
    ;;
esac

if [ -n "${TKV_BIN:-}" ]; then
    br="$TKV_BIN/bench-recall"
    tierkv="$TKV_BIN/tierkv"
else
    if [ ! -f "$build/CMakeCache.txt" ]; then
        log "configuring $build from $root"
        cmake -B "$build" -S "$root" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 > "$OUT/cmake.log" 2>&1 ||
            { tail -20 "$OUT/cmake.log"; exit 1; }
    fi
    cmake --build "$build" -j"$(nproc)" --target bench-recall tierkv > "$OUT/build.log" 2>&1 ||
        { grep -E "error|Error" "$OUT/build.log" | head -20; exit 1; }
    br="$build/bench/bench-recall"
    tierkv="$build/tierkv"
fi

# model SHAPE TYPE [CTX]: the path of a generated model, generated if missing
model() {
    local shape=$1 type=$2 ctx=${3:-}
    local path=/tmp/tkv-${shape//[:,]/_}-$type${ctx:+-$ctx}.gguf
    if [ ! -f "$path" ]; then
        log "gen-model $shape $type ${ctx:+--ctx $ctx}" >&2
        "$tierkv" gen-model --shape "$shape" --type "$type" --seed 1 ${ctx:+--ctx "$ctx"} --out "$path" -t 16 \
            >> "$OUT/gen-model.log" 2>&1 || { log "gen-model $shape $type failed" >&2; tail -3 "$OUT/gen-model.log" >&2; exit 1; }
    fi
    echo "$path"
}

# run NAME STEPS(w,s,x) ARGS...: one bench-recall call within the budget
run() {
    local name=$1 st=$2
    shift 2
    local l
    l=$(left)
    if [ "$l" -lt 30 ]; then
        log "skipped $name: $l s left"
        return 0
    fi
    IFS=, read -r w s x <<< "$st"
    log "bench-recall $name (limit $l s): $*"
    # shellcheck disable=SC2086
    timeout "$l" "$br" --device "$DEVICE" --warmup "$w" --steps "$s" --split-steps "$x" "$@" ${BR_ARGS:-} \
        -j "$OUT/$name.jsonl" > "$OUT/$name.md" 2> "$OUT/$name.err"
    local rc=$?
    grep -E '^(bench-recall|KV|link)' "$OUT/$name.md"
    grep -E '^\|' "$OUT/$name.md"
    grep -A4 '^hetero rates' "$OUT/$name.md"
    [ -s "$OUT/$name.err" ] && grep -v "OpenBLAS" "$OUT/$name.err" | tail -3
    log "$name: exit $rc"
}

# the caps: on a GPU, GPU_KV is the GPU tier; on the CPU it caps the compute tier (host memory)
caps() { # HOST_KV [nvme]
    if [ "$DEVICE" = cpu ]; then
        echo "--host-kv-mem $GPU_KV --nvme-dir $NVME_DIR"
    else
        echo "--gpu-kv-mem $GPU_KV --host-kv-mem $1${2:+ --nvme-dir $NVME_DIR}"
    fi
}

case "$piece" in
build)
    model "$L8_SHAPE" f16 > /dev/null
    model "$L8_SHAPE" q4_0 > /dev/null
    ls -la /tmp/tkv-*.gguf
    df -h /tmp | tail -1
    ;;
l8-f16 | l8-q4_0)
    type=${piece#l8-}
    m=$(model "$L8_SHAPE" "$type")
    # shellcheck disable=SC2046
    run "$piece" "$STEPS_SHORT" -m "$m" --ctx "$CTX_SHORT" $(caps 24G) \
        --policy full --policy rabitq:p=0.9 --policy rabitq:p=0.9,safe=0
    ;;
l8-512k-f16 | l8-512k-q4_0)
    type=${piece#l8-512k-}
    m=$(model "$L8_SHAPE" "$type")
    # shellcheck disable=SC2046
    run "$piece" "$STEPS_LONG" -m "$m" --ctx "$CTX_512K" $(caps "$HOST_KV_512K") \
        --policy full --policy rabitq:p=0.9,safe=0
    ;;
l8-hetero)
    m=$(model "$L8_SHAPE" q4_0)
    run "$piece-full" 2,8,4 -m "$m" --ctx "$CTX_128K" --policy full # the rows' reference: all on the GPU
    for h in auto recall cpu; do
        for w in 2 24; do
            # shellcheck disable=SC2046
            run "$piece-$h-w$w" "$w,8,4" -m "$m" --ctx "$CTX_128K" $(caps 24G) --hetero "$h" \
                --policy rabitq:p=0.9,safe=0
        done
    done
    ;;
qwen-128k | qwen-1m)
    m=$(model "$QW_SHAPE" q4_0 1048576)
    ctx=$CTX_128K
    [ "$piece" = qwen-1m ] && ctx=$CTX_1M
    # shellcheck disable=SC2046
    run "$piece" "$STEPS_LONG" -m "$m" --ctx "$ctx" $(caps "$HOST_KV_1M" nvme) \
        --policy full --policy rabitq:p=0.9,safe=0
    ;;
esac
rm -rf "$NVME_DIR"
log "done"
