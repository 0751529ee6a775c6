#!/usr/bin/env bash
# Installs the Debian packages tierkv builds with, when any is missing:
# a C compiler, CMake, pkg-config, OpenBLAS, hwloc, liburing (and python3 +
# pip, which fetch the model). The CUDA toolkit is optional and not
# installed here (configure picks it up when present).
set -euo pipefail
pkgs=(cmake make gcc g++ pkg-config libopenblas-dev libhwloc-dev liburing-dev)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
command -v python3 >/dev/null || missing+=(python3)
python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
[ ${#missing[@]} -eq 0 ] && exit 0
echo "install-deps: installing ${missing[*]}"
SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
