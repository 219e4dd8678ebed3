#!/usr/bin/env bash
# The GPU figures of revtrain, split by what they settle: groups of points, one group per device call of at most
# 500 s (POINTS=GROUP), each point in its own process (a fresh allocator, so each peak is its own), one JSON
# record each, all gathered into one JSON file.
#
#   POINTS=first_contact scripts/gpu_report.sh [OUT.json]   one group (or several, or point ids; default: all)
#   DRY_RUN=1 POINTS=speed scripts/gpu_report.sh [OUT]      the same points at tiny sizes on the CPU
#
# Groups, in the order a session with a GPU runs them (docs/gpu.md has the one-call command):
#   first_contact  (GROUP_BUDGET_S 225 s: four minutes with the machine's start-up) the runtime's facts:
#     fc_memories   the device's addressable_memories(), default memory, bytes_limit, JAX and jaxlib versions;
#     fc_bandwidth  pinned_host -> device and device -> pinned_host, each alone and both at once (1 GiB copies,
#                   scripts/bench_transfer.py), and from / to numpy;
#     fc_overlap    a 1 GiB pinned_host -> device copy during a long bfloat16 matmul: the matmul alone, the copy
#                   alone, both (the copy issued before and after the matmul's dispatch;
#                   scripts/bench_first_contact.py);
#     fc_pool_grown / fc_pool_prealloc  the pinned pool's resident memory after placing 20 GiB of pinned_host
#                   arrays (256 MiB each), grown (XLA's default) and preallocated (21 GiB), against
#                   revtrain.pinned's prediction;
#     fc_pair_memory / fc_pair_offload  one offload pair: ReversibleTrainer exact + offload against the per-layer
#                   trainer in device memory (d 1024, 4 blocks, T 1,024, batch 8, bfloat16 compute);
#   speed  the speed pairs at d 1024, 16 blocks, T 1,024 (bfloat16 compute): a quick bandwidth (sp_bandwidth),
#     then at batch 8 standard, reversible exact and fused, each per layer in device memory and + offload;
#     at batch 32 reversible exact per layer and + offload;
#   speed_more  depth 4's other trainers (standard, remat, remat + offload, reversible fused in one program, per
#     layer, + offload);
#   budget  the memory-budget curve at depth 16 (GPU_BUDGETS, default 1, 2, 4 and 8 GiB; scripts/bench_budget.py,
#     150 s each: its planner compiles and times each block's modes; a DRY_RUN one budget at depth 2);
#   large  a Llama-2-7B shape (d 4096, 32 blocks, 32 / 32 heads, SwiGLU 11008, bytes; 6.48 B parameters, 72.4 GiB
#     of AdamW float32 state in pinned host memory, the pool preallocated from shapes) on a device capped at
#     24 GB, batch 32 x 1024, 3 steps, no checkpoint (scripts/bench_large.py, LARGE_LIMIT_S, default 450 s);
#   scale  `revtrain train` of the 1.44 B Llama (d 2048, 32 blocks, 16 / 4 heads, SwiGLU 5632; SCALE_SIZE)
#     with ReversibleTrainer + offload, AdamW float32, batch 2 x 128, 3 steps, the final save and evaluation:
#     the host's peak RSS by phase against the plan, the device's peak (scripts/bench_scale.py --quick);
#   disk  the same with offload = 'disk' (DISK_SIZE, default 1.44B);
#   memory  weights + Adam state 3x the device memory it may use (a cap of BIG_CAP_GB, default 3 GB: standard,
#     expected out of memory, and reversible fused + offload), and T 65,536 with blockwise attention.
# Memory caps are bytes (24 GB is 24 GB on an H100 and an H200): XLA_PYTHON_CLIENT_MEM_FRACTION is computed from
# the device's own total (bytes_limit / the fraction it ran under, probed once per call). Each offload point's
# step is given against max(the same trainer's step in device memory, host-to-device bytes / that bandwidth,
# device-to-host bytes / that bandwidth) (the directions run at once), the sum beside it.
# Budget: each group's points start while its own clock is under its budget (GROUP_BUDGET_S overrides all;
# first_contact 225 s, the others 480 s); a point that would start later is recorded as skipped, and each process
# is limited to POINT_LIMIT_S (default 100 s) or what its group has left. A DRY_RUN's groups keep the same budgets
# on a 2-core CPU (docs/gpu.md has their times); a dry run's points share one compilation cache and compile without
# LLVM's optimizations (it checks the wiring, not speed). Each record carries its process's wall seconds (point_s)
# and CPU seconds (point_cpu_s, user + system: what a loaded machine stretches, not what it costs).
# Environment: PYTHON (default .venv/bin/python, else python3).
#
# On a GPU image without network (docs/gpu.md): when the Python packages revtrain imports are missing, they are
# installed from the wheels in REVTRAIN_WHEELS (default .whl; scripts/gpu_wheels.sh makes them), those whose
# distribution the image lacks, into a folder of this run, put first on PYTHONPATH; the prepared data is read
# from REVTRAIN_DATA_DIR (default .gpu_data when that folder exists, with the byte_lm/ folders of the sequence
# lengths used), so nothing is downloaded.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-gpu_report.json}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
POINT_LIMIT_S=${POINT_LIMIT_S:-100}
ALL_GROUPS="first_contact speed speed_more budget large scale disk memory"
POINTS=$(printf '%s' "${POINTS:-$ALL_GROUPS}" | tr ',' ' ')
[ "$POINTS" = all ] && POINTS=$ALL_GROUPS
declare -A GROUP_IDS=(
  [first_contact]="fc_memories fc_bandwidth fc_overlap fc_pool_grown fc_pool_prealloc fc_pair_memory fc_pair_offload"
  [speed]="sp_bandwidth sp_standard_b8 sp_exact_b8 sp_exact_offload_b8 sp_fused_b8 sp_fused_offload_b8 sp_exact_b32 sp_exact_offload_b32"
  [speed_more]="sm_standard sm_remat sm_remat_offload sm_fused sm_fused_layer sm_fused_offload"
  [budget]="bg_budgets"
  [large]="lg_7b" [scale]="sc_1.44b" [disk]="dk_1.44b" [memory]="mm_3x_standard mm_3x_offload mm_long_t")
for w in $POINTS; do  # a name that is neither a group nor a point would select nothing: refused before anything runs
  case " $ALL_GROUPS ${GROUP_IDS[*]} " in
    *" $w "*) ;;
    *) echo "gpu_report: POINTS names '$w', which is neither a group ($ALL_GROUPS) nor a point of one" >&2; exit 2 ;;
  esac
done
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
START=$(date +%s)

# The import names of what the image lacks (docs/gpu.md), then every module of revtrain (a module's imports are
# at its top, so a requirement missing there fails here, not in a point).
IMPORTS="import gin, grain, tensorflow_datasets, tensorboardX, portpicker, array_record, tree, immutabledict, promise, \
simple_parsing, docstring_parser, tensorflow_metadata, google.api, termcolor, toml, importlib_resources, xxhash, \
filelock, cloudpickle
import importlib, pkgutil, revtrain
for module in pkgutil.walk_packages(revtrain.__path__, 'revtrain.'):
    if not module.name.endswith('__main__'):
        importlib.import_module(module.name)"
if ! PYTHONPATH="$PWD:${PYTHONPATH:-}" "$PY" -c "$IMPORTS" 2> "$TMP/import_err"; then
  WHEELS=${REVTRAIN_WHEELS:-.whl}
  if ! ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    echo "gpu_report: $(tail -1 "$TMP/import_err"); no wheels in $WHEELS to install (make them with" \
      "scripts/gpu_wheels.sh $WHEELS where PyPI is reachable, carry the folder: docs/gpu.md)" >&2
    exit 2
  fi
  SITE="$TMP/site"
  # only the wheels whose distribution the image lacks: its own packages were installed together, and a
  # carried copy first on PYTHONPATH would shadow them
  "$PY" -c 'import importlib.metadata as md, os, sys
for wheel in sys.argv[1:]:
    try:
        md.distribution(os.path.basename(wheel).split("-")[0])
    except md.PackageNotFoundError:
        print(wheel)' "$WHEELS"/*.whl > "$TMP/wanted" || exit 2
  mapfile -t WANTED < "$TMP/wanted"
  if [ "${#WANTED[@]}" -gt 0 ] && "$PY" -m pip --version > /dev/null 2>&1; then
    PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps \
      --target "$SITE" "${WANTED[@]}" || exit 2
  else  # no pip on the image: a wheel is a zip of what pip would copy into the target
    for w in "${WANTED[@]}"; do "$PY" -m zipfile -e "$w" "$SITE" || exit 2; done
  fi
  export PYTHONPATH="$SITE:$PWD:${PYTHONPATH:-}"
  if ! "$PY" -c "$IMPORTS" 2> "$TMP/import_err"; then
    echo "gpu_report: still cannot import after installing $WHEELS: $(tail -1 "$TMP/import_err")" >&2
    exit 2
  fi
  echo "gpu_report: installed ${#WANTED[@]} of $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS (the image has" \
    "the others' distributions)" >&2
fi
if [ -z "${REVTRAIN_DATA_DIR:-}" ] && [ -d .gpu_data ]; then
  export REVTRAIN_DATA_DIR="$PWD/.gpu_data"
fi
[ -n "${REVTRAIN_DATA_DIR:-}" ] && echo "gpu_report: prepared data from $REVTRAIN_DATA_DIR" >&2


DRY=${DRY_RUN:-0}
if [ "$DRY" = 1 ]; then
  export JAX_PLATFORMS=cpu
  # A dry run checks the wiring, not speed: its points share one compilation cache (JAX's persistent cache,
  # for this run only), so a program that an earlier point compiled (the same per-layer programs at the same
  # tiny shapes) is read back instead of compiled again (on this 2-core CPU compilation is most of a point's
  # CPU time: 13.6 s of CPU for a dry-run offload point without the cache, 4.5 s with it; docs/gpu.md).
  export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$TMP/jax_cache}
  export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}
  export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=${JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES:--1}
  # and compile without LLVM's optimizations (10.3 s of CPU for that point against 13.6-17.2 s).
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0"
fi
export PYTHONPATH="${PYTHONPATH:-$PWD}"

n=0
GROUP=""
GROUP_START=$START
GROUP_BUDGET=480
group() {  # group NAME BUDGET_S: the points that follow belong to NAME, with its own clock and budget
  GROUP=$1
  GROUP_BUDGET=${GROUP_BUDGET_S:-$2}
  GROUP_START=$(date +%s)
  selected_group && echo "gpu_report: group $GROUP (budget $GROUP_BUDGET s)" >&2
}
selected_group() {  # the current group is named in POINTS, or one of its points is
  local w
  for w in $POINTS; do
    case " $GROUP ${GROUP_IDS[$GROUP]:-} " in *" $w "*) return 0 ;; esac
  done
  return 1
}
selected() {  # selected ID: POINTS names ID or its group
  local w
  for w in $POINTS; do
    [ "$w" = "$1" ] || [ "$w" = "$GROUP" ] && return 0
  done
  return 1
}

cpu_seconds() {  # cpu_seconds FILE: user + system seconds of the children in a `times` output (its 2nd line)
  sed -n 2p "$1" | awk '{ n = 0; for (i = 1; i <= 2; i++) { split($i, a, /[ms]/); n += a[1] * 60 + a[2] }; print n }'
}

point() {  # [SCRIPT=scripts/X.py] point ID NAME [env assignments --] the script's arguments (default bench_trainers.py)
  local id=$1 name=$2; shift 2
  selected "$id" || return 0
  n=$((n + 1))
  local file="$TMP/$(printf %02d $n).json"
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  local now=$(( $(date +%s) - GROUP_START ))
  if [ $((now + 10)) -gt "$GROUP_BUDGET" ]; then
    printf '{"name": "%s", "point_id": "%s", "group": "%s", "status": "skipped", "error": "past the group budget of %s s"}\n' \
      "$name" "$id" "$GROUP" "$GROUP_BUDGET" > "$file"
    echo "gpu_report: $id skipped (budget)" >&2
    return
  fi
  local limit=$POINT_LIMIT_S left=$((GROUP_BUDGET - now))
  [ "$left" -lt "$limit" ] && limit=$left
  echo "gpu_report: $id: $name" >&2
  local t0=$(date +%s)
  times > "$TMP/times0"  # (the CPU seconds of this shell's children, before and after: the point's own)
  env "${envs[@]}" timeout -k 5 "$limit" "$PY" "${SCRIPT:-scripts/bench_trainers.py}" "$@" > "$TMP/out" 2> "$TMP/err"
  local rc=$? seconds=$(( $(date +%s) - t0 ))
  times > "$TMP/times1"
  local cpu
  cpu=$(cpu_seconds "$TMP/times1")-$(cpu_seconds "$TMP/times0")
  cpu=$(awk "BEGIN { printf \"%.1f\", $cpu }")
  local line
  line=$(grep '^{' "$TMP/out" | tail -1)
  if [ -n "$line" ]; then
    printf '%s\n' "$line" | "$PY" -c 'import json,sys; r=json.loads(sys.stdin.read()); r.update(name=sys.argv[1], point_id=sys.argv[2], group=sys.argv[3], point_s=int(sys.argv[4]), point_cpu_s=float(sys.argv[5])); print(json.dumps(r))' \
      "$name" "$id" "$GROUP" "$seconds" "$cpu" > "$file"
  else
    local why="exit status $rc"
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && why="killed after $limit s"
    local tail_err
    tail_err=$(tail -1 "$TMP/err" | tr -d '"\\' | tr -d '\000-\037' | cut -c1-300)
    printf '{"name": "%s", "point_id": "%s", "group": "%s", "status": "error", "error": "%s: %s", "point_s": %s, "point_cpu_s": %s}\n' \
      "$name" "$id" "$GROUP" "$why" "$tail_err" "$seconds" "$cpu" > "$file"
  fi
  echo "gpu_report: $id $(grep -o '"status": "[^"]*"' "$file") in $seconds s" >&2
}

DEVICE_TOTAL=""
cap_fraction() {  # cap_fraction BYTES: XLA_PYTHON_CLIENT_MEM_FRACTION for a cap of BYTES on this device
  if [ "$DRY" = 1 ]; then echo 0.5; return; fi  # (the CPU backend has no device memory cap)
  if [ -z "$DEVICE_TOTAL" ]; then
    DEVICE_TOTAL=$(XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout -k 5 60 "$PY" \
      scripts/bench_first_contact.py --point memories 2> /dev/null | "$PY" -c \
      'import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1]).get("device_total_bytes_estimate", ""))')
    echo "gpu_report: the device's memory: ${DEVICE_TOTAL:-unknown} bytes" >&2
  fi
  "$PY" -c 'import sys; t=sys.argv[2]; print(f"{min(0.95, int(sys.argv[1]) / int(t)):.4f}" if t else "0.17")' "$1" "$DEVICE_TOTAL"
}

if [ "$DRY" = 1 ]; then
  D=64; T=64; B=2; B_BIG=4; HEADS=4; DEEP=4; SHALLOW=2; STEPS=2
  TRANSFER=(--mib 16 --repeats 2); QUICK_TRANSFER=(--mib 8 --repeats 1)
  OVERLAP=(--mib 16 --matmul 256 --loops 4 --repeats 2); POOL=(--gib 0.25 --chunk_mib 16)
  LARGE=(--d_model 64 --num_layers 2 --num_heads 4 --num_kv_heads 4 --d_ff 128 --batch 2 --seq 64 --steps 2)
  LARGE_NAME="tiny Llama (the 6.48 B point's script)"
  SCALE_SIZE=tiny; DISK_SIZE=tiny; LONG_T=1024; LONG_BLOCK=128; BIG_D=64; BIG_LAYERS=4
  BUDGETS="64MiB"; BUDGET_DEPTH=2; BUDGET_LIMIT_S=470
else
  D=1024; T=1024; B=8; B_BIG=32; HEADS=8; DEEP=16; SHALLOW=4; STEPS=3
  TRANSFER=(--mib 1024 --repeats 5); QUICK_TRANSFER=(--mib 256 --repeats 3)
  OVERLAP=(--mib 1024 --matmul 8192 --loops 40 --repeats 3); POOL=(--gib 20 --chunk_mib 256)
  LARGE=(); LARGE_NAME="Llama-2-7B shape (6.48 B)"
  SCALE_SIZE=${SCALE_SIZE:-1.44B}; DISK_SIZE=${DISK_SIZE:-1.44B}; LONG_T=65536; LONG_BLOCK=1024
  # d_model 2048: 50 M parameters a block, 0.6 GB of weights + Adam; 16 blocks ~ 9.7 GB, 3.2x a 3 GB cap.
  BIG_D=${BIG_D:-2048}; BIG_LAYERS=${BIG_LAYERS:-16}; BUDGETS=${GPU_BUDGETS:-1GiB 2GiB 4GiB 8GiB}
  BUDGET_DEPTH=16; BUDGET_LIMIT_S=150
fi
COMMON=(--d_model "$D" --seq "$T" --heads "$HEADS" --compute_dtype bfloat16 --warmup 1 --steps "$STEPS")
LARGE_CAP=${LARGE_CAP_GB:-24}000000000
BIG_CAP=${BIG_CAP_GB:-3}000000000
SCALE_LIMIT_S=${SCALE_LIMIT_S:-420}
LARGE_LIMIT_S=${LARGE_LIMIT_S:-450}

group first_contact 225
SCRIPT=scripts/bench_first_contact.py point fc_memories "the device's memories and limits" -- --point memories
SCRIPT=scripts/bench_transfer.py point fc_bandwidth "host <-> device bandwidth, alone and at once" -- "${TRANSFER[@]}"
SCRIPT=scripts/bench_first_contact.py point fc_overlap "a host-to-device copy during a long matmul" -- \
  --point overlap "${OVERLAP[@]}"
SCRIPT=scripts/bench_first_contact.py point fc_pool_grown "pinned pool, grown: RSS after placing ${POOL[1]} GiB" \
  XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE=false -- --point pinned_pool "${POOL[@]}"
SCRIPT=scripts/bench_first_contact.py point fc_pool_prealloc "pinned pool, preallocated: RSS after placing ${POOL[1]} GiB" \
  XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE=true XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=21 -- --point pinned_pool "${POOL[@]}"
point fc_pair_memory "reversible exact per layer, depth $SHALLOW" -- --point "reversible exact per layer" \
  --depth "$SHALLOW" --batch "$B" "${COMMON[@]}"
point fc_pair_offload "reversible exact + offload, depth $SHALLOW" -- --point "reversible exact + offload" \
  --depth "$SHALLOW" --batch "$B" "${COMMON[@]}"

group speed 480
SCRIPT=scripts/bench_transfer.py point sp_bandwidth "host <-> device bandwidth (quick)" -- "${QUICK_TRANSFER[@]}"
for pair in "sp_standard_b8:standard:$B" "sp_exact_b8:reversible exact per layer:$B" \
            "sp_exact_offload_b8:reversible exact + offload:$B" "sp_fused_b8:reversible fused per layer:$B" \
            "sp_fused_offload_b8:reversible fused + offload:$B" "sp_exact_b32:reversible exact per layer:$B_BIG" \
            "sp_exact_offload_b32:reversible exact + offload:$B_BIG"; do
  IFS=: read -r id cfg batch <<< "$pair"
  point "$id" "$cfg, depth $DEEP, batch $batch" -- --point "$cfg" --depth "$DEEP" --batch "$batch" "${COMMON[@]}"
done

group speed_more 480
for pair in "sm_standard:standard" "sm_remat:remat" "sm_remat_offload:remat + offload" "sm_fused:reversible fused" \
            "sm_fused_layer:reversible fused per layer" "sm_fused_offload:reversible fused + offload"; do
  IFS=: read -r id cfg <<< "$pair"
  point "$id" "$cfg, depth $SHALLOW" -- --point "$cfg" --depth "$SHALLOW" --batch "$B" "${COMMON[@]}"
done
group budget 480
for budget in $BUDGETS; do  # (the budget's planner compiles and times each block's modes: a longer limit)
  POINT_LIMIT_S=$BUDGET_LIMIT_S SCRIPT=scripts/bench_budget.py point bg_budgets "budgeted fused $budget, depth $BUDGET_DEPTH" \
    -- --point "budgeted fused" --budget "$budget" --depth "$BUDGET_DEPTH" --d_model "$D" --seq "$T" --batch "$B" \
    --heads "$HEADS" --compute_dtype bfloat16 --rounds "$STEPS"
done

group large 480
if selected lg_7b; then LARGE_FRACTION=$(cap_fraction "$LARGE_CAP"); fi
POINT_LIMIT_S=$LARGE_LIMIT_S SCRIPT=scripts/bench_large.py point lg_7b "$LARGE_NAME, device capped at ${LARGE_CAP_GB:-24} GB" \
  XLA_PYTHON_CLIENT_MEM_FRACTION="${LARGE_FRACTION:-0.17}" -- "${LARGE[@]}"

group scale 480
POINT_LIMIT_S=$SCALE_LIMIT_S SCRIPT=scripts/bench_scale.py point sc_1.44b "$SCALE_SIZE Llama, reversible + offload (host and device peaks)" -- \
  --sizes "$SCALE_SIZE" --trainers offload --optimizers adamw --quick --timeout "$SCALE_LIMIT_S" --out "$TMP/bench_scale.out"

group disk 480
POINT_LIMIT_S=$SCALE_LIMIT_S SCRIPT=scripts/bench_scale.py point dk_1.44b "$DISK_SIZE Llama, reversible + offload='disk'" -- \
  --sizes "$DISK_SIZE" --trainers disk --optimizers adamw --quick --timeout "$SCALE_LIMIT_S" --out "$TMP/bench_disk.out"

group memory 480
if selected mm_3x_standard || selected mm_3x_offload; then BIG_FRACTION=$(cap_fraction "$BIG_CAP"); fi
for pair in "mm_3x_standard:standard" "mm_3x_offload:reversible fused + offload"; do
  IFS=: read -r id cfg <<< "$pair"
  point "$id" "state 3x device memory, $cfg" XLA_PYTHON_CLIENT_MEM_FRACTION="${BIG_FRACTION:-0.02}" -- --point "$cfg" \
    --depth "$BIG_LAYERS" --d_model "$BIG_D" --heads 16 --seq 1024 --batch 1 --compute_dtype bfloat16 --warmup 1 --steps 2
done
point mm_long_t "T $LONG_T blockwise, reversible fused + offload" -- --point "reversible fused + offload" --depth "$SHALLOW" \
  --d_model "$D" --heads 8 --seq "$LONG_T" --batch 1 --compute_dtype bfloat16 --bench_attention_block "$LONG_BLOCK" \
  --ff_chunk "$LONG_BLOCK" --head_chunk "$LONG_BLOCK" --warmup 1 --steps 1

if [ "$n" = 0 ]; then
  echo "gpu_report: POINTS=$POINTS names no group or point (groups: $ALL_GROUPS)" >&2
  exit 2
fi
"$PY" - "$OUT" "$TMP" "$(( $(date +%s) - START ))" "$DRY" "$POINTS" <<'EOF'
import json, pathlib, sys
out, tmp, seconds, dry, points = sys.argv[1], pathlib.Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5]
records = [json.loads(p.read_text()) for p in sorted(tmp.glob("*.json"))]
# Each offload point against the larger of the same trainer's step in device memory, its host-to-device bytes over
# that bandwidth and its device-to-host bytes over that one (the two directions run at once on a GPU's copy
# engines: fc_bandwidth's both_to_max says whether they do), the sum of the three beside it.
bw = next((r for r in records if r.get("h2d_pinned_bytes_per_sec")), None)
for r in records:
    if not (r.get("moved_h2d_bytes") and r.get("step_s") and bw):
        continue
    h2d = r["moved_h2d_bytes"] / bw["h2d_pinned_bytes_per_sec"]
    d2h = r["moved_d2h_bytes"] / bw["d2h_pinned_bytes_per_sec"]
    same = ("depth", "d_model", "seq", "batch", "compute_dtype", "attention_block")
    mem = next((m for m in records if m.get("step_s") and not m.get("offload")
                and m.get("config") == r["config"].replace(" + offload", " per layer")
                and all(m.get(k) == r.get(k) for k in same)), None)
    r["memory_step_s"] = mem["step_s"] if mem else None
    r["h2d_s"], r["d2h_s"] = h2d, d2h
    r["bound_s"] = max(r["memory_step_s"] or 0.0, h2d, d2h)
    r["sum_s"] = (r["memory_step_s"] or 0.0) + h2d + d2h
    r["ratio_to_bound"] = r["step_s"] / r["bound_s"]
    if mem and mem.get("tokens_per_sec") and r.get("tokens_per_sec"):
        r["tokens_per_sec_to_memory"] = r["tokens_per_sec"] / mem["tokens_per_sec"]
report = {"dry_run": dry, "points": points, "seconds": seconds, "records": records, "group_seconds": {}}
report["group_cpu_seconds"] = {}
for r in records:
    g = r.get("group", "")
    report["group_seconds"][g] = report["group_seconds"].get(g, 0) + r.get("point_s", 0)
    report["group_cpu_seconds"][g] = round(report["group_cpu_seconds"].get(g, 0) + r.get("point_cpu_s", 0), 1)
pathlib.Path(out).write_text(json.dumps(report, indent=1) + "\n")
G = 2**30
pad = " " * 23
print(f"{'point':<22} {'configuration':<58} {'status':<14} {'tokens/s':>10} {'peak MiB':>10} {'s':>4}")
for r in records:
    tps = f"{r['tokens_per_sec']:,.0f}" if "tokens_per_sec" in r else "-"
    peak = f"{r['peak_device_bytes'] / 2**20:,.0f}" if "peak_device_bytes" in r else "-"
    print(f"{r.get('point_id', ''):<22} {r['name'][:58]:<58} {r['status']:<14} {tps:>10} {peak:>10} "
          f"{r.get('point_s', '')!s:>4}")
    if r.get("status") != "ok" and r.get("error"):
        print(f"{pad}{r['error'][:150]}")
    if "memories" in r:
        print(f"{pad}{r.get('device_kind')}: memories {r['memories']} (default {r.get('default_memory')}), bytes_limit "
              f"{r.get('device_bytes_limit', 0) / 1e9:.1f} GB (total ~{r.get('device_total_bytes_estimate', 0) / 1e9:.1f} "
              f"GB); JAX {r.get('jax')} / jaxlib {r.get('jaxlib')}")
    if "run_peak_bytes" in r:
        print(f"{pad}host peak {r['run_peak_bytes'] / G:.2f} GiB ({r['run_peak_bytes'] / r['num_params']:.1f} "
              f"B/param; plan {r.get('plan_host_bytes', 0) / G:.2f} GiB), device peak "
              f"{r.get('peak_device_bytes', 0) / G:.2f} GiB ({r.get('peak_device_bytes_method')})")
        plan = r.get("plan_host_bytes") or 0
        print(f"{pad}host peak by phase, GiB (/ plan): " + ", ".join(
            f"{k} {v / G:.2f}" + (f" ({v / plan:.2f})" if plan else "") for k, v in r.get("peak_bytes", {}).items()))
    if "h2d_pinned_bytes_per_sec" in r:
        both = (f"; both at once {r['both_to_max']:.2f}x the longer alone, {r['both_to_sum']:.2f}x the sum"
                if "both_pinned_s" in r else "")
        print(f"{pad}pinned_host -> device {r['h2d_pinned_bytes_per_sec'] / 1e9:.1f} GB/s, device -> pinned_host "
              f"{r['d2h_pinned_bytes_per_sec'] / 1e9:.1f} GB/s{both} (numpy: "
              f"{r['h2d_pageable_bytes_per_sec'] / 1e9:.1f} / {r['d2h_pageable_bytes_per_sec'] / 1e9:.1f})")
    if r.get("point") == "overlap" and r.get("status") == "ok":
        print(f"{pad}matmul {r['matmul_s'] * 1e3:.1f} ms ({r['matmul_tflops']:.0f} TFLOP/s), copy "
              f"{r['copy_s'] * 1e3:.1f} ms; both: copy first {r['copy_first_s'] * 1e3:.1f} ms "
              f"({r['copy_first_to_max']:.2f}x the longer), matmul first {r['matmul_first_s'] * 1e3:.1f} ms "
              f"({r['matmul_first_to_max']:.2f}x; 1.00 overlaps, {r['sum_to_max']:.2f} is the sum)")
    if r.get("point") == "pinned_pool" and r.get("status") == "ok":
        print(f"{pad}{r['placed_bytes'] / G:.2f} GiB placed in {r['place_s']:.1f} s: RSS +{r['rss_added_bytes'] / G:.2f} "
              f"GiB ({r['rss_added_to_placed']:.2f}x), predicted pool {r['predicted_pool_bytes'] / G:.2f} GiB "
              f"({r['pool_source']})")
    if "ratio_to_bound" in r:
        mem = f"{r['memory_step_s']:.3f} s" if r["memory_step_s"] else "not measured"
        vs = f"; {r['tokens_per_sec_to_memory']:.2f}x the in-memory tokens/s" if "tokens_per_sec_to_memory" in r else ""
        print(f"{pad}step {r['step_s']:.3f} s = {r['ratio_to_bound']:.2f}x max(in memory {mem}, h2d "
              f"{r['moved_h2d_bytes'] / 1e9:.2f} GB / bw = {r['h2d_s']:.3f} s, d2h {r['moved_d2h_bytes'] / 1e9:.2f} GB "
              f"/ bw = {r['d2h_s']:.3f} s) = {r['bound_s']:.3f} s (sum {r['sum_s']:.3f} s){vs}")
    if "mfu" in r:
        print(f"{pad}{r['num_params'] / 1e9:.2f} B params: host peak {r['host_peak_bytes'] / G:.1f} GiB "
              f"({r['host_bytes_per_param']} B/param), device peak {r.get('peak_device_bytes', 0) / G:.2f} GiB of "
              f"{r.get('device_bytes_limit', 0) / 1e9:.1f} GB, MFU {100 * r['mfu']:.1f}%, init {r['init_s']} s; "
              f"{r.get('memory_line', '')}")
    if "state_bytes" in r and "device_bytes_limit" in r and r["name"].startswith("state"):
        print(f"{pad}weights + Adam {r['state_bytes'] / G:.1f} GiB = "
              f"{r['state_bytes'] / r['device_bytes_limit']:.1f}x the device limit")
counts = {}
for r in records:  # a status's first word: ok, error, skipped, killed, ...
    word = str(r.get("status", "?")).split(" ")[0] or "?"
    counts[word] = counts.get(word, 0) + 1
print("points by status: " + ", ".join(f"{n} {word}" for word, n in counts.items()) + f" (of {len(records)})")
print("seconds by group (its points' processes): " + ", ".join(f"{g} {s}" for g, s in report["group_seconds"].items()))
print("CPU seconds by group (user + system of its points' processes): "
      + ", ".join(f"{g} {s}" for g, s in report["group_cpu_seconds"].items()))
print(f"wrote {out} ({seconds} s)")
EOF
