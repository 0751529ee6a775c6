#!/bin/bash
# gpu-run.sh -- build and test the CUDA backend on the lent GPU machine (the
# `run` tool of this workplace), from a clean snapshot of the tree.
#
# Other engineers edit the shared checkout while GPU runs are in flight, so
# the device builds a snapshot: the last commit (git archive HEAD) with the
# GPU files of the working tree laid over it.
#
#   scripts/gpu-run.sh snap [--head]   here: write .gpu-snap/ (git-ignored);
#                                      --head: the last commit only (when
#                                      others' uncommitted GPU files would
#                                      not build)
#   scripts/gpu-run.sh bins [TARGET..] here: build TARGETs (default: the GPU
#                                      tests and benchmarks, tierkv) in
#                                      build/release and pack them into
#                                      .gpu-bin/bins.tar.xz (git-ignored):
#                                      ~20 MB for ten binaries, which share
#                                      their device code (xz -9e, one stream)
#                                      -- no build on the device (2-3 minutes
#                                      of its time per machine start saved);
#                                      there: mkdir -p /tmp/b && tar -C /tmp/b
#                                      -xJf .gpu-bin/bins.tar.xz, after
#                                      `source .device/bootstrap.sh`
#   scripts/gpu-run.sh model           here: split the model into .gpu-model/
#   scripts/gpu-run.sh peer [ARCH]     here: build llama.cpp's llama-bench
#                                      with its CUDA backend (ARCH, default
#                                      90) from the llama.cpp tree inside the
#                                      llama-cpp-python sdist (PyPI), static
#                                      ggml, into .gpu-peer/llama-bench.xz
#                                      (~41 MB: carried without .device;
#                                      ~25 minutes on 2 cores); there:
#                                      xz -dc .gpu-peer/llama-bench.xz > /tmp/llama-bench
#   scripts/gpu-run.sh test [sanitize] there: build .gpu-snap, run ctest -R gpu, kv-store, hetero
#                                      (and compute-sanitizer memcheck)
#   scripts/gpu-run.sh bench           there: build and run bench-attn
#   scripts/gpu-run.sh attn [sanitize|-] [decode|prefill|decode,prefill]
#                                      there: build only test-gpu-backend and
#                                      bench-attn; the test (and memcheck over
#                                      its attention section), then the decode
#                                      benchmark (default) and/or the causal
#                                      prefill one, beside torch SDPA and the
#                                      copy bandwidth (scripts/bench-torch-attn.py);
#                                      logs and JSON under $OUT
# On the device: carry .device and .gpu-snap, and start the command with
#   source .device/bootstrap.sh && scripts/gpu-run.sh test
set -euo pipefail
root=$(git rev-parse --show-toplevel 2>/dev/null || pwd)
cd "$root"
snap=.gpu-snap
gpu_files="gpu tests/test-gpu-backend.c tests/test-gpu-e2e.c bench/bench-attn.c scripts/gpu-run.sh scripts/bench-torch-attn.py docs/gpu.md"

exclude() {
    grep -qx "/$1/" .git/info/exclude 2>/dev/null || echo "/$1/" >> .git/info/exclude
}

build() {
    cd "$root/$snap"
    cmake -B /tmp/tkv-build -S . -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 > /dev/null
    cmake --build /tmp/tkv-build -j"$(nproc)" 2>&1 | grep -E "error|warning: .*gpu/|^make.*Error" || true
    cmake --build /tmp/tkv-build -j"$(nproc)" > /dev/null # fail here if it did not build
}

case "${1:-}" in
snap)
    exclude "$snap"
    rm -rf "$snap"
    mkdir -p "$snap"
    git archive HEAD | tar -x -C "$snap"
    if [ "${2:-}" != --head ]; then
        for f in $gpu_files; do
            [ -e "$f" ] && { mkdir -p "$snap/$(dirname "$f")"; cp -r "$f" "$snap/$(dirname "$f")/"; }
        done
    fi
    [ -d tests/data ] && cp -r tests/data "$snap/tests/" || true
    echo "snapshot of $(git rev-parse --short HEAD) + GPU files in $snap ($(du -sh "$snap" | cut -f1))"
    ;;
bins)
    exclude .gpu-bin
    shift
    targets=${*:-test-gpu-backend test-gpu-rabitq test-kv-table test-kv-store test-hetero test-gpu-e2e bench-attn bench-recall bench-decode tierkv}
    # shellcheck disable=SC2086
    cmake --build build/release -j"$(nproc)" --target $targets > /dev/null
    stage=$(mktemp -d)
    for t in $targets; do
        f=$(find build/release -maxdepth 2 -type f -name "$t" -perm -u+x | head -1)
        [ -n "$f" ] || { echo "no binary $t in build/release" >&2; exit 1; }
        cp "$f" "$stage/"
    done
    mkdir -p .gpu-bin
    tar -C "$stage" -c . | xz -9e -T1 > .gpu-bin/bins.tar.xz
    rm -rf "$stage"
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- gpu runtime tiers cpu io tests bench || echo +changes): $targets"
    ls -l .gpu-bin/bins.tar.xz
    ;;
peer)
    # the peer of bench-decode (docs/benchmarks.md): llama.cpp's own
    # benchmark on the same GGUF. It needs only the CUDA runtime and cuBLAS,
    # which the device has; OpenMP, NCCL, OpenSSL and curl are left out.
    exclude .gpu-peer
    arch=${2:-90}
    work=/tmp/tkv-peer
    mkdir -p "$work"
    python3 -m pip download --no-deps --no-binary :all: llama-cpp-python -d "$work" > /dev/null
    sdist=$(ls -t "$work"/llama_cpp_python-*.tar.gz | head -1)
    tar -xzf "$sdist" -C "$work"
    src=$(ls -d "$work"/llama_cpp_python-*/vendor/llama.cpp | tail -1)
    cmake -B "$src/build" -S "$src" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" \
        -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DGGML_CUDA_NCCL=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > /dev/null
    cmake --build "$src/build" -j"$(nproc)" --target llama-bench > /dev/null
    mkdir -p .gpu-peer
    strip -o "$work/llama-bench" "$src/build/bin/llama-bench"
    xz -9e -T"$(nproc)" -c "$work/llama-bench" > .gpu-peer/llama-bench.xz
    echo "llama-bench from $(basename "$sdist") for sm_$arch:"
    ls -l .gpu-peer/llama-bench.xz
    ;;
model)
    # the model (98 MB) is larger than one call may carry (64 MiB with the
    # tree): three parts of at most 34 MiB, one per call while the machine
    # is warm (the first beside .device, 13 MB, and the packed binaries,
    # ~11 MB each); on the device
    #   mkdir -p /tmp/m && cat .gpu-model/a/* > /tmp/m/part.a               (call 1)
    #   cat /tmp/m/part.a .gpu-model/b/* > /tmp/m/part.ab                    (call 2)
    #   cat /tmp/m/part.ab .gpu-model/c/* > /tmp/m/model.gguf                (call 3)
    exclude .gpu-model
    rm -rf .gpu-model && mkdir -p .gpu-model/a .gpu-model/b .gpu-model/c
    split -b 34M models/SmolLM2-135M-Instruct.Q4_1.gguf .gpu-model/part.
    mv .gpu-model/part.aa .gpu-model/a/ && mv .gpu-model/part.ab .gpu-model/b/ && mv .gpu-model/part.a[c-z] .gpu-model/c/
    ls -l .gpu-model/*/
    ;;
test)
    build
    cd "$root/$snap"
    # tests find the model at models/ (tests/CMakeLists.txt); /tmp/m holds it
    # on the device once both parts were carried
    if [ -f /tmp/m/model.gguf ]; then
        mkdir -p models && ln -sf /tmp/m/model.gguf models/SmolLM2-135M-Instruct.Q4_1.gguf
    fi
    # the GPU tests, and the store and hetero tests, whose configurations
    # include a real GPU tier where one is
    ctest --test-dir /tmp/tkv-build -R "gpu|kv-store|hetero" -V > /tmp/ctest.log 2>&1 || rc=$?
    grep -v "Test command\|Test timeout\|^UpdateCTest\|^Parse\|Environment\|^Constructing\|^Checking\|^Updating\|^Add " /tmp/ctest.log
    if [ "${2:-}" = sanitize ]; then
        for t in test-gpu-backend test-gpu-rabitq; do
            echo "== memcheck $t"
            timeout 300 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
                /tmp/tkv-build/tests/$t 2>&1 | grep -E "ERROR SUMMARY|Invalid|checks,|SKIP|failed|^=========" | head -40 || true
        done
    fi
    exit "${rc:-0}"
    ;;
attn)
    cd "$root/$snap"
    out=${OUT:-/tmp/tkv-out}
    mkdir -p "$out"
    t0=$(date +%s)
    cmake -B /tmp/tkv-build -S . -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 > "$out/cmake.log" 2>&1 \
        || { tail -30 "$out/cmake.log"; exit 1; }
    if ! cmake --build /tmp/tkv-build -j"$(nproc)" --target test-gpu-backend bench-attn > "$out/build.log" 2>&1; then
        grep -E "error|Error" "$out/build.log" | head -30
        exit 1
    fi
    grep -E "warning: .*gpu/" "$out/build.log" | head -10 || true
    echo "== built in $(( $(date +%s) - t0 )) s"
    rc=0
    timeout 120 /tmp/tkv-build/tests/test-gpu-backend > "$out/test.log" 2>&1 || rc=$?
    grep -E "^attention|  attn |checks|FAIL|fail" "$out/test.log" | head -70
    echo "== test-gpu-backend exit $rc ($(( $(date +%s) - t0 )) s)"
    if [ "${2:-}" = sanitize ]; then
        src=0
        TKV_TEST_ONLY=attention timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
            /tmp/tkv-build/tests/test-gpu-backend > "$out/memcheck.log" 2>&1 || src=$?
        grep -E "ERROR SUMMARY|Invalid|checks,|^=========" "$out/memcheck.log" | head -20
        echo "== memcheck (attention section) exit $src ($(( $(date +%s) - t0 )) s)"
    fi
    sections=${3:-decode}
    : > "$out/ours.json"
    dsizes=; psizes=
    for sec in ${sections//,/ }; do
        brc=0
        [ "$sec" = prefill ] && bsec=prefill-long || bsec=$sec
        timeout 150 /tmp/tkv-build/bench/bench-attn -s "$bsec" -j "$out/$sec.json" > "$out/bench-$sec.log" 2>&1 || brc=$?
        cat "$out/bench-$sec.log"
        cat "$out/$sec.json" >> "$out/ours.json" 2>/dev/null || true
        echo "== bench-attn -s $bsec exit $brc ($(( $(date +%s) - t0 )) s)"
        [ "$sec" = decode ] && dsizes=32768,131072,1048576
        [ "$sec" = prefill ] && psizes=8192,32768,131072
    done
    PYTHONUNBUFFERED=1 timeout 150 python3 scripts/bench-torch-attn.py --ours "$out/ours.json" --sizes "$dsizes" \
        --prefill "$psizes" --json "$out/vs-torch.json" > "$out/torch.log" 2>&1 || echo "== torch exit $?"
    grep -v '^{' "$out/torch.log" | grep -v "UserWarning\|call = lambda\|lambda: F.scaled"
    nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,power.draw,temperature.gpu --format=csv
    echo "== done in $(( $(date +%s) - t0 )) s"
    exit "$rc"
    ;;
bench)
    build
    cd "$root/$snap"
    /tmp/tkv-build/bench/bench-attn "${@:2}"
    ;;
*)
    sed -n '2,45p' "$0"
    exit 2
    ;;
esac
