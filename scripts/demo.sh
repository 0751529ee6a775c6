#!/usr/bin/env bash
# The main job, end to end on a fresh machine: install what is missing,
# build tierkv, fetch SmolLM2-135M-Instruct, and answer a question about a
# long document (docs/demo/harbor-report.txt) with `tierkv run`.
#
#   scripts/demo.sh ["your question"]
set -euo pipefail
cd "$(dirname "$0")/.."
QUESTION=${1:-"Who led the restoration of the Gull Point lighthouse, and what did it cost?"}

scripts/install-deps.sh
scripts/get-model.sh
if [ ! -x build/release/tierkv ]; then
    cmake -S . -B build/release -DCMAKE_BUILD_TYPE=Release >/dev/null
fi
cmake --build build/release -j "$(nproc)" --target tierkv >/dev/null

echo "document: docs/demo/harbor-report.txt ($(wc -w <docs/demo/harbor-report.txt) words)"
echo "question: $QUESTION"
echo "answer:"
build/release/tierkv run -m models/SmolLM2-135M-Instruct.Q4_1.gguf \
    -f docs/demo/harbor-report.txt -p "$QUESTION" --chat --temp 0 -n 96 --stats
