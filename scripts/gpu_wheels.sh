#!/usr/bin/env bash
# The Python 3.12 wheels the GPU image lacks, downloaded into one folder to carry there (it has no network:
# docs/gpu.md). scripts/gpu_report.sh installs them from that folder when imports fail.
#
#   scripts/gpu_wheels.sh [DIR]     (default .whl, which git ignores; PyPI must be reachable)
#
# Each package at its version in constraints.txt, without its dependencies, as a manylinux x86-64 / pure-Python
# wheel for CPython 3.12; a package published as an sdist only (promise) is built into a wheel here (pure Python,
# so the wheel built by this machine's Python serves 3.12 too). Two lists: revtrain's requirements that the image
# is known to lack, and every other requirement of theirs but the large ones the image has (numpy, pyarrow):
# small wheels the image may or may not have (cloudpickle, which Grain needs, was missing from a Python 3.12 with
# only the image's named packages). gpu_report.sh installs a wheel only where the image has no distribution of
# that name, so carrying one the image has costs only its bytes.
# Environment: PYTHON (default .venv/bin/python, else python3), GPU_PYTHON_VERSION (default 3.12).
set -eu
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
VERSION=${GPU_PYTHON_VERSION:-3.12}
# What the image has (its Python 3.12 as the first GPU trial found it), with whatever these require.
IMAGE_HAS="jax jaxlib flax optax orbax-checkpoint absl-py etils tensorstore numpy safetensors tokenizers sentencepiece
pyarrow matplotlib pytest"
# pip names, as constraints.txt spells them: revtrain's requirements the image lacks (xxhash: the disk tier's
# checksums; filelock: the compile cache's eviction lock; six: promise imports it; 11 kB, in case the image has
# no six)
PACKAGES="gin-config grain tensorflow-datasets tensorboardX portpicker array_record dm-tree immutabledict promise
simple-parsing docstring_parser tensorflow-metadata googleapis-common-protos termcolor toml importlib_resources six
xxhash filelock"
# Their requirements, found by `pip install --dry-run --ignore-installed --report` of the list above with
# constraints.txt, less numpy and pyarrow (tests/test_gpu_carry.py checks that none the image's packages do not
# bring is left out)
DEPENDENCIES="absl-py attrs certifi charset-normalizer cloudpickle einops etils fsspec idna packaging protobuf psutil
requests tqdm typing_extensions urllib3 wrapt zipp"
# revtrain's requirements not carried: Hugging Face datasets, imported only to prepare a corpus from the Hub
# (revtrain.data.corpus), which the report does not do (it reads data prepared here)
NOT_CARRIED="datasets"
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
for pkg in $PACKAGES $DEPENDENCIES; do
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
