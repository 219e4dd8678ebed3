"""The memory plan's host estimate against the measured peak (docs/memory.md).

Runs ``revtrain train`` (3 steps, batch 2 x 128, a LlamaModel of the given sizes on configs/llama_small.gin)
once per configuration, each in its own process, and prints one JSON line per run: the plan's host estimate
(``plan_host_bytes`` of the first train.jsonl record), the child's peak resident bytes (``ru_maxrss`` of the
finished child: its VmHWM), the plan's parts, and the ratio.

  python scripts/measure_plan.py --d_model 512 --num_layers 8 --d_ff 1408 --trainer standard reversible
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINERS = {
    "standard": ["train.trainer = @StandardTrainer"],
    "reversible": ["train.trainer = @ReversibleTrainer"],
    "reversible_offload": ["train.trainer = @ReversibleTrainer", "ReversibleTrainer.offload = True"],
    "reversible_adafactor": ["train.trainer = @ReversibleTrainer", "train.optimizer = @optax.adafactor"],
}


def run_one(d_model: int, num_layers: int, d_ff: int, heads: int, kv_heads: int, trainer: str, timeout: int) -> dict:
    workdir = tempfile.mkdtemp(prefix="plan_")
    shutil.rmtree(workdir)
    gin = ["STEPS = 3", "WARMUP = 1", "train.batch_size = 2", "train.log_every = 1", "ByteLMTask.sequence_length = 128",
           f"LlamaModel.d_model = {d_model}", f"LlamaModel.num_layers = {num_layers}", f"LlamaModel.d_ff = {d_ff}",
           f"LlamaModel.num_heads = {heads}", f"LlamaModel.num_kv_heads = {kv_heads}", "evaluate.max_batches = 1",
           "train.sample_every = 0"] + TRAINERS[trainer]
    cmd = [os.path.join(ROOT, ".venv", "bin", "revtrain"), "train", "--config", os.path.join(ROOT, "configs", "llama_small.gin"),
           "--workdir", workdir] + [a for g in gin for a in ("--gin", g)]
    t0 = time.time()
    proc = subprocess.run(["timeout", "-k", "10", str(timeout)] + cmd, capture_output=True, text=True)
    wall = time.time() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the largest finished child so far
    out = {"d_model": d_model, "num_layers": num_layers, "d_ff": d_ff, "trainer": trainer, "rc": proc.returncode,
           "wall_s": round(wall, 1)}
    try:
        with open(os.path.join(workdir, "metrics", "train.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
        first = records[0]
        out.update({k: v for k, v in first.items() if k.startswith(("plan_", "host_"))})
        # The peak up to the end of the last step (before the final checkpoint, evaluation and exit).
        out["step_peak_bytes"] = records[-1]["host_peak_bytes"]
        out["step_resident_bytes"] = records[-1]["host_resident_bytes"]
        out["measured_peak_bytes"] = peak
        out["estimate_over_measured"] = round(first["plan_host_bytes"] / peak, 3)
    except (OSError, ValueError, KeyError):
        out["stderr"] = proc.stderr.strip().splitlines()[-1:] if proc.stderr else []
    shutil.rmtree(workdir, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--d_model", type=int, default=512)
    p.add_argument("--num_layers", type=int, default=8)
    p.add_argument("--d_ff", type=int, default=1408)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--trainer", nargs="+", default=["standard", "reversible"], choices=sorted(TRAINERS))
    p.add_argument("--timeout", type=int, default=500)
    a = p.parse_args()
    # ru_maxrss of RUSAGE_CHILDREN is the largest finished child's: run each configuration in a fresh
    # interpreter so that every figure is that run's own.
    if len(a.trainer) > 1:
        for t in a.trainer:
            subprocess.run([sys.executable, __file__, "--d_model", str(a.d_model), "--num_layers", str(a.num_layers),
                            "--d_ff", str(a.d_ff), "--heads", str(a.heads), "--kv_heads", str(a.kv_heads),
                            "--timeout", str(a.timeout), "--trainer", t], check=False)
        return
    print(json.dumps(run_one(a.d_model, a.num_layers, a.d_ff, a.heads, a.kv_heads, a.trainer[0], a.timeout)), flush=True)


if __name__ == "__main__":
    main()
