#!/usr/bin/env bash
# Configures and builds rdmavirt into a build directory.
#   tools/build.sh [BUILD_DIR [extra cmake args...]]
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$top/build}
shift || true
cmake -S "$top" -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" > "$dir.cmake.log" 2>&1 || {
  mkdir -p "$dir"; cat "$dir.cmake.log" >&2; exit 1; }
cmake --build "$dir" -j"$(nproc)"
