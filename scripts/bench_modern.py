"""The modern parts' two benchmarks: step time of configs/enwik_modern.gin against configs/enwik_small.gin, and the
RevViT's peak device memory against depth.

  python scripts/bench_modern.py --steptime [--steps 30] [--rounds 3]      (both byte LMs, side by side)
  python scripts/bench_modern.py --memory [--depths 6,12,24]               (RevViT vs StandardTrainer)
  [--out bench_modern.json]

**Step time**: the models of ``configs/enwik_small.gin`` (learned positions, LayerNorm, GELU, multi-head
attention) and ``configs/enwik_modern.gin`` (rotary positions, RMSNorm, SwiGLU, grouped-query attention),
each with the ReversibleTrainer and the optimizer of its config, on the same real batches (32 x 128 bytes).
After two warm-up steps each (compilation), ``--rounds`` interleaved rounds of ``--steps`` steps of each
model (so that machine noise hits both alike); the step time is the median over rounds of each round's
mean. Prints the ratio modern / default.

**Memory**: the RevViT of ``configs/revvit_fashion_mnist.gin`` at each depth of ``--depths`` (couplings),
StandardTrainer, ReversibleTrainer and ReversibleTrainer with offload, one training step on real
Fashion-MNIST images after a warm-up step, peak device bytes from the memory meter (``revtrain.memory``: the
allocator's peak on GPU/TPU, measured one configuration per process; the live-array + compiled-temp
estimate on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

try:
    import revtrain  # noqa: F401
except ImportError:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import gin  # noqa: E402
import jax  # noqa: E402

from revtrain import loop  # noqa: E402
from revtrain import registry  # noqa: E402,F401  (gin configurables)
from revtrain.ginconfig import include_search_path  # noqa: E402
from revtrain.memory import MemoryMeter  # noqa: E402
from revtrain.placement import global_batch, make_mesh  # noqa: E402
from revtrain.trainers import ReversibleTrainer, StandardTrainer  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = {"default": REPO / "configs" / "enwik_small.gin", "modern": REPO / "configs" / "enwik_modern.gin"}
REVVIT = REPO / "configs" / "revvit_fashion_mnist.gin"


def _parse(path, bindings=()):
    gin.clear_config()
    with include_search_path():
        gin.parse_config_files_and_bindings([str(path)], list(bindings), finalize_config=False)


def _built(path, bindings=(), trainer_cls=None, **trainer_kwargs):
    """``(run, batches iterator)`` of a config: task, model, optimizer and trainer as ``revtrain train``
    builds them (``trainer_cls`` replaces the config's trainer)."""
    _parse(path, bindings)
    cfg = loop.TrainConfig()
    run = loop.build(cfg)
    if trainer_cls is not None:
        run.trainer = trainer_cls(run.model, run.trainer.tx, run.mesh, seed=0, **trainer_kwargs)
    it = run.task.train_iterator(cfg.batch_size, 0, 0, 1)
    return run, it


def steptime(args) -> dict:
    runs, states, batches = {}, {}, {}
    for name, path in CONFIGS.items():
        run, it = _built(path)
        batch = [global_batch(next(it), run.mesh) for _ in range(4)]
        ts = run.trainer.init()
        for b in batch[:2]:  # warm-up: compilation
            ts, m = run.trainer.train_step(ts, b)
        jax.block_until_ready(m)
        runs[name], states[name], batches[name] = run, ts, batch
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            ts, start = states[name], time.perf_counter()
            for i in range(args.steps):
                ts, m = run.trainer.train_step(ts, batches[name][i % len(batches[name])])
            jax.block_until_ready((ts.params, m))
            times[name].append((time.perf_counter() - start) / args.steps)
            states[name] = ts
    step = {k: statistics.median(v) for k, v in times.items()}
    record = {"step_seconds": step, "rounds": times, "steps_per_round": args.steps,
              "params": {k: r.model.num_params() for k, r in runs.items()},
              "ratio": step["modern"] / step["default"], "load_average": os.getloadavg()}
    print(f"{'model':<8} {'params':>10} {'s/step':>8}")
    for k in runs:
        print(f"{k:<8} {record['params'][k]:>10,} {step[k]:>8.3f}")
    print(f"modern / default step time: {record['ratio']:.3f} (median of {args.rounds} interleaved rounds of "
          f"{args.steps} steps; load average {record['load_average'][0]:.1f})")
    return record


def memory_one(kind: str, depth: int) -> tuple[int, str]:
    """Peak device bytes of one RevViT step at ``depth`` couplings for ``kind`` (standard, reversible,
    offload), after a warm-up step."""
    cls, kwargs = {"standard": (StandardTrainer, {}), "reversible": (ReversibleTrainer, {}),
                   "offload": (ReversibleTrainer, {"offload": True})}[kind]
    run, it = _built(REVVIT, [f"NUM_LAYERS = {depth}"], cls, **kwargs)
    meter = MemoryMeter()
    run.trainer.meter = meter
    ts = run.trainer.init()
    ts, m = run.trainer.train_step(ts, global_batch(next(it), run.mesh))
    jax.block_until_ready(m)
    meter.start()
    ts, m = run.trainer.train_step(ts, global_batch(next(it), run.mesh))
    jax.block_until_ready((ts.params, m))
    return meter.stop(), meter.method


def memory(args) -> dict:
    rows = []
    for depth in args.depths:
        for kind in ("standard", "reversible", "offload"):
            cmd = [sys.executable, __file__, "--memory_one", f"{kind},{depth}"]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            peak, method = out.split()
            rows.append({"depth": depth, "trainer": kind, "peak_bytes": int(peak), "method": method})
            print(f"depth {depth:>3} {kind:<10} {int(peak) / 2**20:8.1f} MiB ({method})", flush=True)
    by = {(r["trainer"], r["depth"]): r["peak_bytes"] for r in rows}
    lo, hi = min(args.depths), max(args.depths)
    ratios = {k: by[(k, hi)] / by[(k, lo)] for k in ("standard", "reversible", "offload")}
    print(f"peak at depth {hi} / depth {lo}: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    return {"rows": rows, "ratio_deepest_to_shallowest": ratios}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--steptime", action="store_true")
    p.add_argument("--memory", action="store_true")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--depths", default="6,12,24", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--out", default="bench_modern.json")
    p.add_argument("--memory_one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.memory_one:
        kind, depth = args.memory_one.split(",")
        peak, method = memory_one(kind, int(depth))
        print(peak, method)
        return {}
    if not (args.steptime or args.memory):
        p.error("give --steptime and/or --memory")
    record = {"platform": jax.devices()[0].platform, "cpu_count": os.cpu_count()}
    if args.steptime:
        record["steptime"] = steptime(args)
    if args.memory:
        record["memory"] = memory(args)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
