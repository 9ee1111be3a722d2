#!/usr/bin/env bash
# Download the wheels benchmarks/gpu/check.sh installs on a GPU machine with no internet: CPython 3.12,
# manylinux x86_64 (the H200 machine's Python), everything in requirements.txt and what it needs,
# never torch or triton (the machine has its own). Run here, before the GPU session:
#
#     bash benchmarks/gpu/fetch_wheels.sh            # -> benchmarks/gpu/wheels (git-ignored, ~50 MB)
#
# The folder travels with the device run as a carried path (`carry: ["benchmarks/gpu/wheels"]`).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
DEST="${1:-$HERE/wheels}"
PY="${PYTHON:-python3}"
PYVER="${GPU_PYTHON_VERSION:-3.12}"
ABI="cp${PYVER/./}"
mkdir -p "$DEST"
"$PY" -m pip download --quiet --dest "$DEST" --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --python-version "$PYVER" --implementation cp --abi "$ABI" --abi abi3 --abi none \
    -r "$HERE/requirements.txt"
# torch or triton pulled in by a dependency would replace the machine's own: never ship them.
rm -f "$DEST"/torch-*.whl "$DEST"/triton-*.whl "$DEST"/nvidia_*.whl
du -sh "$DEST"
ls "$DEST" | wc -l
