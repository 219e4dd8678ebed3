#!/usr/bin/env bash
# The Python 3.12 wheels the GPU image lacks, downloaded into one folder to carry there (it has no network:
# docs/gpu.md). scripts/gpu_report.sh installs them from that folder when imports fail.
#
#   scripts/gpu_wheels.sh [DIR]     (default .whl, which git ignores; PyPI must be reachable)
#
# Each package at its version in constraints.txt, without its dependencies (the image has the rest), as a
# manylinux x86-64 / pure-Python wheel for CPython 3.12; a package published as an sdist only (promise) is
# built into a wheel here (pure Python, so the wheel built by this machine's Python serves 3.12 too).
# Environment: PYTHON (default .venv/bin/python, else python3), GPU_PYTHON_VERSION (default 3.12).
set -eu
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
VERSION=${GPU_PYTHON_VERSION:-3.12}
# pip names, as constraints.txt spells them (six: promise imports it; 11 kB, in case the image has no six)
PACKAGES="gin-config grain tensorflow-datasets tensorboardX portpicker array_record dm-tree immutabledict promise
simple-parsing docstring_parser tensorflow-metadata googleapis-common-protos termcolor toml importlib_resources six"
SDIST_ONLY="promise"

pin() {  # the name==version line of constraints.txt (names compared as pip does: case, -, _ and . alike)
  local norm
  norm=$(printf %s "$1" | tr 'A-Z_.' 'a-z--')
  while IFS= read -r line; do
    local name=${line%%==*}
    [ "$(printf %s "$name" | tr 'A-Z_.' 'a-z--')" = "$norm" ] && { printf '%s\n' "$line"; return; }
  done < constraints.txt
  echo "gpu_wheels: $1 has no pin in constraints.txt" >&2
  exit 2
}

mkdir -p "$DIR"
PLATFORMS=()
for p in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64; do
  PLATFORMS+=(--platform "$p")
done
for pkg in $PACKAGES; do
  spec=$(pin "$pkg")
  if [[ " $SDIST_ONLY " == *" $pkg "* ]]; then
    "$PY" -m pip wheel -q --no-deps --wheel-dir "$DIR" "$spec"
  else
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$VERSION" --implementation cp \
      "${PLATFORMS[@]}" --dest "$DIR" "$spec"
  fi
done
count=$(ls "$DIR"/*.whl | wc -l)
echo "gpu_wheels: $count wheels in $DIR, $(du -sh "$DIR" | cut -f1) in all"
