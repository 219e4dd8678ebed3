#!/usr/bin/env bash
# The device call rehearsed on this machine: scripts/gpu_report.sh run as the GPU image would run it, on a
# Python 3.12 that has only the image's packages (IMAGE_HAS of scripts/gpu_wheels.sh, at the image's versions:
# JAX 0.11.2, Flax 0.12.10, optax 0.2.8, Orbax 0.12.4; the CPU jaxlib), with no network (`unshare -n`: needs
# root), an empty HOME (no data or compile cache), the carried .whl and .gpu_data only, DRY_RUN=1, and the
# pageable host kind switched off (REVTRAIN_NO_PAGEABLE_HOST=1, unless set: the host tier takes the pinned path
# a GPU has). An import the image lacks, a download, a missing data folder fails here as it would there
# (docs/gpu.md).
#
#   POINTS=first_contact scripts/gpu_rehearse.sh [OUT]     (POINTS as gpu_report.sh's; default first_contact)
#
# The venv is made once in REHEARSAL_VENV (default /tmp/revtrain_image312; PyPI must be reachable then).
# Environment: PYTHON312 (a Python 3.12; else python3.12 or pyenv's), REHEARSAL_VENV.
set -eu
cd "$(dirname "$0")/.."
OUT=${1:-gpu_rehearsal.json}
VENV=${REHEARSAL_VENV:-/tmp/revtrain_image312}
IMAGE_VERSIONS="jax==0.11.2 jaxlib==0.11.2 flax==0.12.10 optax==0.2.8 orbax-checkpoint==0.12.4"

for folder in .whl .gpu_data; do
  [ -d "$folder" ] || { echo "gpu_rehearse: no $folder here: make it as docs/gpu.md says" >&2; exit 2; }
done
if [ ! -x "$VENV/bin/python" ]; then
  py312=
  for candidate in ${PYTHON312:-} python3.12 "$HOME"/.pyenv/versions/3.12.*/bin/python; do
    if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      py312=$candidate
      break
    fi
  done
  [ -n "$py312" ] || { echo "gpu_rehearse: no Python 3.12 (set PYTHON312)" >&2; exit 2; }
  image=$(sed -n '/^IMAGE_HAS="/,/"/p' scripts/gpu_wheels.sh | tr -d '"' | sed 's/^IMAGE_HAS=//')
  named=
  for package in $image; do  # the image's versions where known, the newest of the others
    pinned=$package
    for version in $IMAGE_VERSIONS; do [ "${version%%==*}" = "$package" ] && pinned=$version; done
    named="$named $pinned"
  done
  "$py312" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check $named
fi
NET=(unshare -n)
if ! unshare -n true 2>/dev/null; then
  echo "gpu_rehearse: unshare -n is not permitted here: rehearsing with the network on" >&2
  NET=()
fi
home=$(mktemp -d)
trap 'rm -rf "$home"' EXIT
HOME=$home DRY_RUN=1 POINTS=${POINTS:-first_contact} PYTHON="$VENV/bin/python" \
  REVTRAIN_NO_PAGEABLE_HOST=${REVTRAIN_NO_PAGEABLE_HOST:-1} "${NET[@]}" \
  scripts/gpu_report.sh "$OUT"
