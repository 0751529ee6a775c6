#!/usr/bin/env bash
# The test command: installs what is missing (Debian packages, the model),
# builds the Release tree and the ASan/UBSan tree, and runs ctest in both.
# Exits non-zero on any failure; the last line is ctest's summary.
#
#   scripts/test.sh                 everything (what CI runs)
#   JOBS=4 scripts/test.sh          parallel build/test jobs (default: nproc)
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}

# ---- 1. Debian packages ---------------------------------------------------------
scripts/install-deps.sh

# ---- 2. the default model (tests that need it read TKV_MODEL) --------------------
scripts/get-model.sh

# ---- 3. Release tree (CUDA code compiles where the toolkit is) -------------------
cmake -S . -B build/release -DCMAKE_BUILD_TYPE=Release -DTKV_FATAL_WARNINGS=ON >/dev/null
cmake --build build/release -j "$JOBS"

# ---- 4. ASan + UBSan tree ---------------------------------------------------------
cmake -S . -B build/asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g" \
      -DTKV_SANITIZE=ON -DTKV_CUDA=OFF -DTKV_BUILD_BENCH=OFF -DTKV_FATAL_WARNINGS=ON >/dev/null
cmake --build build/asan -j "$JOBS"

# ---- 5. TSan tree, for the tests that run threads (pool, I/O, tiers) ---------------
cmake -S . -B build/tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g" \
      -DTKV_SANITIZE_THREAD=ON -DTKV_CUDA=OFF -DTKV_BUILD_BENCH=OFF -DTKV_FATAL_WARNINGS=ON >/dev/null
cmake --build build/tsan -j "$JOBS" --target test-cpu-backend test-io test-kv-store test-kv-file test-forward
TSAN_TESTS='^(test-cpu-backend|test-io|test-kv-store|test-kv-file|test-forward)$'

# ---- 6. tests -----------------------------------------------------------------------
status=0
echo "== ctest: Release =="
ctest --test-dir build/release --output-on-failure -j "$JOBS" 2>&1 | tee build/release/ctest.log || status=1
echo "== ctest: ASan + UBSan =="
UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build/asan --output-on-failure -j "$JOBS" 2>&1 | tee build/asan/ctest.log || status=1
echo "== ctest: TSan (threaded tests) =="
TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
    ctest --test-dir build/tsan -R "$TSAN_TESTS" --output-on-failure -j "$JOBS" 2>&1 | tee build/tsan/ctest.log || status=1
for t in release asan tsan; do grep -q "tests failed out of" build/$t/ctest.log || status=1; done
echo "== summary =="
echo "release: $(grep 'tests failed out of' build/release/ctest.log)"
echo "tsan:    $(grep 'tests failed out of' build/tsan/ctest.log)"
echo "asan:    $(grep 'tests failed out of' build/asan/ctest.log)"
grep 'tests failed out of' build/asan/ctest.log
exit $status
