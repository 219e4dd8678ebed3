#!/usr/bin/env bash
# The GPU figures of revtrain in one run: every configuration in its own process (a fresh allocator, so each
# peak is its own), one JSON record each, all gathered into one JSON file.
#
#   scripts/gpu_report.sh [OUT.json]          on a machine with one GPU (default out: gpu_report.json)
#   DRY_RUN=1 scripts/gpu_report.sh [OUT]     every configuration at tiny sizes on the CPU (checks the script)
#
# Configurations (scripts/bench_trainers.py --point LABEL; see docs/rebuild.md):
#   1. standard, remat (scan + jax.checkpoint), remat + offload (saved inputs in host memory), reversible
#      (fused rebuild), reversible + offload, at depth 4 and
#      16, d_model 1024, T 1,024, batch 8, bfloat16 compute;
#   2. T 65,536 with blockwise attention (chunked feed-forward and head), reversible + offload, depth 4, batch 1;
#   3. a model whose weights + Adam state are at least 3x the device memory it may use
#      (XLA_PYTHON_CLIENT_MEM_FRACTION): the standard trainer (expected: out of memory) and the reversible
#      trainer with offload (expected: trains), and the ratio state_bytes / device_bytes_limit in the record;
#   4. the memory-budget curve (scripts/bench_budget.py --point, docs/budget.md): ReversibleTrainer.memory_budget
#      (fused rebuild for its rebuilt blocks) at the sizes of 1 and each budget of GPU_BUDGETS (default 1, 2, 4
#      and 8 GiB), its tokens/s, allocator peak and plan, beside 1.'s fixed trainers;
#   5. the large-model point (scripts/bench_scale.py --quick, docs/memory.md): `revtrain train` of the 1.44 B
#      Llama (d 2048, 32 blocks, 16 / 4 heads, SwiGLU 5632; SCALE_SIZE) with ReversibleTrainer + offload,
#      AdamW float32, batch 2 x 128, 3 steps, the final save and evaluation: the host's peak RSS by phase
#      (VmHWM) against the memory plan, and the device's peak_bytes_in_use (memory_stats). It runs first, in
#      SCALE_LIMIT_S seconds (default 300);
#   6. the disk tier (docs/disk.md): the same `revtrain train` with ReversibleTrainer.offload = 'disk' (per-layer
#      executor; DISK_SIZE, default 1.44B): disk -> pageable host buffers -> device, a layer at a time; the
#      host's and device's peaks, each step's bytes read and written and the I/O time against the plan's.
#   7. host <-> device bandwidth (scripts/bench_transfer.py, 1 GiB copies between pinned_host and device memory,
#      and from / to numpy), first: the summary divides each offload point's bytes moved a step by it and gives
#      the ratio of its step to max(the same trainer's step in device memory, bytes moved / bandwidth);
#   8. a 7 B Llama-shaped model on a device capped at 24 GB (scripts/bench_large.py: XLA_PYTHON_CLIENT_MEM_FRACTION
#      = 24/141 of an H200; d 4096, 32 blocks, 32 / 8 heads, SwiGLU 11008, bytes, AdamW float32, batch 32 x 1024,
#      3 steps, no checkpoint) with ReversibleTrainer + offload: host peak, device peak, tokens/s and MFU over
#      989 TFLOP/s, in LARGE_LIMIT_S seconds (default 240), right after 5.
# Budget: BUDGET_S seconds in all (default 480); a configuration that would start after the budget is
# recorded as skipped, and each process is limited to POINT_LIMIT_S seconds (default 100). A DRY_RUN on a
# 2-core CPU needs more (about 1,250 s for every point: BUDGET_S=1500 POINT_LIMIT_S=400).
# Environment: PYTHON (default .venv/bin/python, else python3).
#
# On a GPU image without network (docs/gpu.md): when the Python packages revtrain imports are missing, they are
# installed from the wheels in REVTRAIN_WHEELS (default .whl; scripts/gpu_wheels.sh makes them) into a folder
# of this run, put first on PYTHONPATH; the prepared data is read from REVTRAIN_DATA_DIR (default .gpu_data when
# that folder exists, with the byte_lm/ folders of the sequence lengths used), so nothing is downloaded.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-gpu_report.json}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
BUDGET_S=${BUDGET_S:-480}
POINT_LIMIT_S=${POINT_LIMIT_S:-100}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
START=$(date +%s)

# The import names of what the image lacks (docs/gpu.md), then revtrain's own imports.
IMPORTS="import gin, grain, tensorflow_datasets, tensorboardX, portpicker, array_record, tree, immutabledict, promise, \
simple_parsing, docstring_parser, tensorflow_metadata, google.api, termcolor, toml, importlib_resources, \
revtrain.cli, revtrain.data.byte_lm"
if ! PYTHONPATH="$PWD:${PYTHONPATH:-}" "$PY" -c "$IMPORTS" 2> "$TMP/import_err"; then
  WHEELS=${REVTRAIN_WHEELS:-.whl}
  if ! ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    echo "gpu_report: $(tail -1 "$TMP/import_err"); no wheels in $WHEELS to install (make them with" \
      "scripts/gpu_wheels.sh $WHEELS where PyPI is reachable, carry the folder: docs/gpu.md)" >&2
    exit 2
  fi
  SITE="$TMP/site"
  if "$PY" -m pip --version > /dev/null 2>&1; then
    PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps \
      --target "$SITE" "$WHEELS"/*.whl || exit 2
  else  # no pip on the image: a wheel is a zip of what pip would copy into the target
    for w in "$WHEELS"/*.whl; do "$PY" -m zipfile -e "$w" "$SITE" || exit 2; done
  fi
  export PYTHONPATH="$SITE:$PWD:${PYTHONPATH:-}"
  if ! "$PY" -c "$IMPORTS" 2> "$TMP/import_err"; then
    echo "gpu_report: still cannot import after installing $WHEELS: $(tail -1 "$TMP/import_err")" >&2
    exit 2
  fi
  echo "gpu_report: installed $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS" >&2
fi
if [ -z "${REVTRAIN_DATA_DIR:-}" ] && [ -d .gpu_data ]; then
  export REVTRAIN_DATA_DIR="$PWD/.gpu_data"
fi
[ -n "${REVTRAIN_DATA_DIR:-}" ] && echo "gpu_report: prepared data from $REVTRAIN_DATA_DIR" >&2

if [ "${DRY_RUN:-0}" = 1 ]; then
  export JAX_PLATFORMS=cpu
  D=64; T=64; B=2; DEPTHS="2 4"; LONG_T=1024; LONG_BLOCK=128; BIG_D=64; BIG_LAYERS=4; FRACTION=0.02; SCALE_SIZE=tiny
else
  D=1024; T=1024; B=8; DEPTHS="4 16"; LONG_T=65536; LONG_BLOCK=1024; FRACTION=${BIG_FRACTION:-0.02}
  # d_model 2048: 50M parameters per block, 0.6 GB of weights + Adam; 16 blocks ~ 9.7 GB, 3.4x of 2% of an
  # 141 GB device. (On a smaller GPU raise BIG_FRACTION or lower BIG_LAYERS; the record gives the ratio.)
  BIG_D=${BIG_D:-2048}; BIG_LAYERS=${BIG_LAYERS:-16}; SCALE_SIZE=${SCALE_SIZE:-1.44B}
fi
SCALE_LIMIT_S=${SCALE_LIMIT_S:-300}
[ "${DRY_RUN:-0}" = 1 ] && DISK_SIZE=tiny || DISK_SIZE=${DISK_SIZE:-1.44B}

n=0
point() {  # [SCRIPT=scripts/X.py] point NAME [env assignments --] the script's arguments (default bench_trainers.py)
  local name=$1; shift
  n=$((n + 1))
  local file="$TMP/$(printf %02d $n).json"
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  local now=$(( $(date +%s) - START ))
  if [ $((now + 20)) -gt "$BUDGET_S" ]; then
    printf '{"name": "%s", "status": "skipped", "error": "past the %s s budget"}\n' "$name" "$BUDGET_S" > "$file"
    echo "gpu_report: $name skipped (budget)" >&2
    return
  fi
  local limit=$POINT_LIMIT_S left=$((BUDGET_S - now))
  [ "$left" -lt "$limit" ] && limit=$left
  echo "gpu_report: $name" >&2
  env "${envs[@]}" timeout -k 5 "$limit" "$PY" "${SCRIPT:-scripts/bench_trainers.py}" "$@" > "$TMP/out" 2> "$TMP/err"
  local rc=$?
  local line
  line=$(grep '^{' "$TMP/out" | tail -1)
  if [ -n "$line" ]; then
    printf '%s\n' "$line" | "$PY" -c 'import json,sys; r=json.loads(sys.stdin.read()); r["name"]=sys.argv[1]; print(json.dumps(r))' "$name" > "$file"
  else
    local why="exit status $rc"
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && why="killed after $limit s"
    local tail_err
    tail_err=$(tail -1 "$TMP/err" | tr -d '"\\' | tr -d '\000-\037' | cut -c1-300)
    printf '{"name": "%s", "status": "error", "error": "%s: %s"}\n' "$name" "$why" "$tail_err" > "$file"
  fi
  grep -o '"status": "[^"]*"' "$file" >&2
}

if [ "${DRY_RUN:-0}" = 1 ]; then
  TRANSFER=(--mib 16 --repeats 2)
  LARGE=(--d_model 64 --num_layers 2 --num_heads 4 --num_kv_heads 2 --d_ff 128 --batch 2 --seq 64 --steps 2); LARGE_NAME="tiny"
else
  TRANSFER=(--mib 1024 --repeats 5)
  LARGE=(); LARGE_NAME="7B"
fi
LARGE_FRACTION=${LARGE_FRACTION:-0.17}  # 24 GB of an H200's 141 GB
LARGE_LIMIT_S=${LARGE_LIMIT_S:-240}
SCRIPT=scripts/bench_transfer.py point "host <-> device bandwidth" -- "${TRANSFER[@]}"
POINT_LIMIT_S=$SCALE_LIMIT_S SCRIPT=scripts/bench_scale.py point "$SCALE_SIZE Llama, reversible + offload (host and device peaks)" -- \
  --sizes "$SCALE_SIZE" --trainers offload --optimizers adamw --quick --timeout "$SCALE_LIMIT_S" --out "$TMP/bench_scale.out"
POINT_LIMIT_S=$LARGE_LIMIT_S SCRIPT=scripts/bench_large.py point "$LARGE_NAME Llama, device capped at 24 GB, reversible + offload" \
  XLA_PYTHON_CLIENT_MEM_FRACTION="$LARGE_FRACTION" -- "${LARGE[@]}"
POINT_LIMIT_S=$SCALE_LIMIT_S SCRIPT=scripts/bench_scale.py point "$DISK_SIZE Llama, reversible + offload='disk'" -- \
  --sizes "$DISK_SIZE" --trainers disk --optimizers adamw --quick --timeout "$SCALE_LIMIT_S" --out "$TMP/bench_disk.out"

COMMON=(--d_model "$D" --seq "$T" --batch "$B" --heads 8 --compute_dtype bfloat16 --warmup 1 --steps 3)
[ "${DRY_RUN:-0}" = 1 ] && COMMON=(--d_model "$D" --seq "$T" --batch "$B" --heads 4 --compute_dtype bfloat16 --warmup 1 --steps 2)
for depth in $DEPTHS; do
  for cfg in "standard" "remat" "remat + offload" "reversible fused" "reversible exact per layer" \
             "reversible exact + offload" "reversible fused per layer" "reversible fused + offload"; do
    point "$cfg, depth $depth" -- --point "$cfg" --depth "$depth" "${COMMON[@]}"
  done
done
BUDGETS=${GPU_BUDGETS:-1GiB 2GiB 4GiB 8GiB}
[ "${DRY_RUN:-0}" = 1 ] && BUDGETS="8MiB 64MiB"
for depth in $DEPTHS; do
  for budget in $BUDGETS; do
    SCRIPT=scripts/bench_budget.py point "budgeted fused $budget, depth $depth" -- --point "budgeted fused" \
      --budget "$budget" --depth "$depth" --d_model "$D" --seq "$T" --batch "$B" --heads 8 --compute_dtype bfloat16 \
      --rounds 3
  done
done
point "T $LONG_T blockwise, reversible fused + offload" -- --point "reversible fused + offload" --depth 4 \
  --d_model "$D" --heads 8 --seq "$LONG_T" --batch 1 --compute_dtype bfloat16 --bench_attention_block "$LONG_BLOCK" \
  --ff_chunk "$LONG_BLOCK" --head_chunk "$LONG_BLOCK" --warmup 1 --steps 1
for cfg in "standard" "reversible fused + offload"; do
  point "state 3x device memory, $cfg" XLA_PYTHON_CLIENT_MEM_FRACTION="$FRACTION" -- --point "$cfg" \
    --depth "$BIG_LAYERS" --d_model "$BIG_D" --heads 16 --seq 1024 --batch 1 --compute_dtype bfloat16 \
    --warmup 1 --steps 2
done

"$PY" - "$OUT" "$TMP" "$(( $(date +%s) - START ))" "${DRY_RUN:-0}" <<'EOF'
import json, pathlib, sys
out, tmp, seconds, dry = sys.argv[1], pathlib.Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
records = [json.loads(p.read_text()) for p in sorted(tmp.glob("*.json"))]
# Each offload point against the larger of the same trainer's step in device memory and its bytes moved over the
# bandwidth measured in this run (pinned_host <-> device).
bw = next((r for r in records if r.get("h2d_pinned_bytes_per_sec")), None)
for r in records:
    if not (r.get("moved_h2d_bytes") and r.get("step_s") and bw):
        continue
    r["transfer_bound_s"] = r["moved_h2d_bytes"] / bw["h2d_pinned_bytes_per_sec"] + \
        r["moved_d2h_bytes"] / bw["d2h_pinned_bytes_per_sec"]
    same = ("config", "depth", "d_model", "seq", "batch", "compute_dtype", "attention_block")
    mem = next((m for m in records if m.get("step_s") and not m.get("offload")
                and m.get("config") == r["config"].replace(" + offload", " per layer")
                and all(m.get(k) == r.get(k) for k in same[1:])), None)
    r["memory_step_s"] = mem["step_s"] if mem else None
    r["ratio_to_bound"] = r["step_s"] / max(r["memory_step_s"] or 0.0, r["transfer_bound_s"])
report = {"dry_run": dry, "seconds": seconds, "records": records}
pathlib.Path(out).write_text(json.dumps(report, indent=1) + "\n")
print(f"{'configuration':<58} {'status':<14} {'tokens/s':>10} {'peak MiB':>10}")
for r in records:
    tps = f"{r['tokens_per_sec']:,.0f}" if "tokens_per_sec" in r else "-"
    peak = f"{r['peak_device_bytes'] / 2**20:,.0f}" if "peak_device_bytes" in r else "-"
    print(f"{r['name']:<58} {r['status']:<14} {tps:>10} {peak:>10}")
    if "run_peak_bytes" in r:
        print(f"{'':<58} host peak {r['run_peak_bytes'] / 2**30:.2f} GiB ({r['run_peak_bytes'] / r['num_params']:.1f} "
              f"B/param; plan {r.get('plan_host_bytes', 0) / 2**30:.2f} GiB), device peak "
              f"{r.get('peak_device_bytes', 0) / 2**30:.2f} GiB ({r.get('peak_device_bytes_method')})")
        plan = r.get("plan_host_bytes") or 0
        print(f"{'':<58} host peak by phase, GiB (/ plan): " + ", ".join(
            f"{k} {v / 2**30:.2f}" + (f" ({v / plan:.2f})" if plan else "") for k, v in r.get("peak_bytes", {}).items()))
    if "h2d_pinned_bytes_per_sec" in r:
        print(f"{'':<58} pinned_host -> device {r['h2d_pinned_bytes_per_sec'] / 1e9:.1f} GB/s, device -> pinned_host "
              f"{r['d2h_pinned_bytes_per_sec'] / 1e9:.1f} GB/s (numpy: {r['h2d_pageable_bytes_per_sec'] / 1e9:.1f} / "
              f"{r['d2h_pageable_bytes_per_sec'] / 1e9:.1f})")
    if "ratio_to_bound" in r:
        mem = f"{r['memory_step_s']:.3f} s" if r["memory_step_s"] else "not measured"
        print(f"{'':<58} step {r['step_s']:.3f} s = {r['ratio_to_bound']:.2f}x max(in memory {mem}, "
              f"{(r['moved_h2d_bytes'] + r['moved_d2h_bytes']) / 1e9:.2f} GB moved / bandwidth = "
              f"{r['transfer_bound_s']:.3f} s)")
    if "mfu" in r:
        print(f"{'':<58} {r['num_params'] / 1e9:.2f} B params: host peak {r['host_peak_bytes'] / 2**30:.1f} GiB "
              f"({r['host_bytes_per_param']} B/param), device peak {r.get('peak_device_bytes', 0) / 2**30:.2f} GiB, "
              f"MFU {100 * r['mfu']:.1f}%, init {r['init_s']} s")
    if "state_bytes" in r and "device_bytes_limit" in r and r["name"].startswith("state"):
        print(f"{'':<58} weights + Adam {r['state_bytes'] / 2**30:.1f} GiB = "
              f"{r['state_bytes'] / r['device_bytes_limit']:.1f}x the device limit")
print(f"wrote {out} ({seconds} s)")
EOF
