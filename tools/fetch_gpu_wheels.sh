#!/usr/bin/env bash
# Download the wheels tools/gpu_smoke.sh installs on a GPU machine without network into .whl/ (git-ignored;
# it travels with the working tree, 64 MiB at most): megatron-core 0.16.1 for CPython 3.10-3.13 on x86_64 and
# aarch64 (~2.6 MB each), einops and psutil. About 25 MB in all. TransformerEngine is not fetched: its
# wheels are hundreds of MB.
#
# usage: bash tools/fetch_gpu_wheels.sh [PYTHON]   (PYTHON: the pip to download with, default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
DEST=.whl
mkdir -p "$DEST"
for arch in x86_64 aarch64; do
    for version in 3.10 3.11 3.12 3.13; do
        "$PY" -m pip download -q --no-deps --only-binary=:all: --dest "$DEST" --python-version "$version" \
            --platform "manylinux_2_28_$arch" --platform "manylinux_2_24_$arch" --platform "manylinux_2_17_$arch" \
            --platform "manylinux2014_$arch" megatron-core==0.16.1
    done
    "$PY" -m pip download -q --no-deps --only-binary=:all: --dest "$DEST" --python-version 3.11 \
        --platform "manylinux_2_28_$arch" --platform "manylinux_2_17_$arch" --platform "manylinux2014_$arch" \
        "psutil>=5.9"
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --dest "$DEST" einops==0.8.1
du -sh "$DEST"
ls "$DEST"
