#!/usr/bin/env bash
# make finetune-python WORKDIR=DIR: pretrain a small Llama-style byte LM on enwik (StandardTrainer), export it
# as a Hugging Face checkpoint, then fine-tune that checkpoint on the Python standard library's .py files three
# ways (standard backprop; standard blocks with saved inputs under the ReversibleTrainer; the exact BDIA form
# under the ReversibleTrainer), and print validation bits per byte on held-out Python files before and after.
# Leaves DIR/pretrain (the pretraining run), DIR/pretrained (the exported checkpoint), DIR/standard,
# DIR/saved_inputs, DIR/exact (workdirs that eval, sample and check accept) and DIR/summary.json.
set -euo pipefail
DIR=${1:?usage: finetune_python.sh DIR}
PRETRAIN_STEPS=${PRETRAIN_STEPS:-200}
FINETUNE_STEPS=${FINETUNE_STEPS:-100}
BIN=$(dirname "$0")/../.venv/bin
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
PY_DATA="$DIR/data/python.txt"
[ -f "$PY_DATA" ] || "$BIN/python" scripts/prepare_python.py "$PY_DATA"
SIZE=(--gin 'LlamaModel.num_layers = 4' --gin 'train.batch_size = 16')
if [ ! -d "$DIR/pretrained" ]; then
  "$BIN/revtrain" train --config configs/llama_small.gin --workdir "$DIR/pretrain" "${SIZE[@]}" \
    --gin "STEPS = $PRETRAIN_STEPS" --gin 'WARMUP = 20' --gin 'train.sample_every = 0' --gin 'train.log_every = 50' \
    --gin 'train.checkpoint_every = 0'
  "$BIN/revtrain" export --workdir "$DIR/pretrain" --to "$DIR/pretrained"
fi
# The pretrained model on held-out Python before fine-tuning: its run evaluated on the Python corpus.
"$BIN/revtrain" eval --workdir "$DIR/pretrain" --gin "ByteLMTask.source = '$PY_DATA'" --split validation --name python
FT=(--config configs/finetune_python.gin --gin "LlamaModel.path = '$DIR/pretrained'" --gin "ByteLMTask.source = '$PY_DATA'"
    --gin "STEPS = $FINETUNE_STEPS")
"$BIN/revtrain" train "${FT[@]}" --workdir "$DIR/standard" --gin 'train.trainer = @StandardTrainer'
"$BIN/revtrain" train "${FT[@]}" --workdir "$DIR/saved_inputs" --gin 'train.trainer = @ReversibleTrainer' \
  --gin 'ReversibleTrainer.offload = True'
"$BIN/revtrain" train "${FT[@]}" --workdir "$DIR/exact" --gin 'train.trainer = @ReversibleTrainer' \
  --gin 'ReversibleTrainer.offload = True' --gin "LlamaModel.form = 'exact'"
"$BIN/python" - "$DIR" <<'PY'
import json, os, sys
d = sys.argv[1]
def last(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()][-1]
rows = {}
rows["pretrained (before)"] = last(os.path.join(d, "pretrain", "metrics", "eval_python.jsonl"))
for way in ("standard", "saved_inputs", "exact"):
    rows[way] = last(os.path.join(d, way, "metrics", "eval.jsonl"))
for k, r in rows.items():
    print(f"{k:<20} step {r['step']:>4}  validation bits per byte {r.get('bits_per_byte', float('nan')):.4f}")
with open(os.path.join(d, "summary.json"), "w") as f:
    json.dump(rows, f, indent=1)
PY
