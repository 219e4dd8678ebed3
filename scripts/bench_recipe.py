"""Benchmark of the language-model recipe in the reversible trainer (docs/recipe.md): what global-norm
clipping and gradient accumulation cost against the fused per-layer update.

  python scripts/bench_recipe.py [--rounds 5] [--out bench_recipe.json]

The default run's model (configs/enwik_modern.gin: 6 couplings of grouped-query attention and SwiGLU,
d_model 128, T 128) on the English-Wikipedia excerpt, AdamW, the reversible trainer (exact rebuild),
warmed up (compilation), then timed in interleaved rounds (one step of each configuration per round, so
machine noise hits all alike; the median step time):

* ``fused``: AdamW, batch 32: the per-layer fused update (the reference);
* ``clip``: ``clip_by_global_norm(1.0)`` + AdamW, batch 32: the deferred update (a statistics pass, the
  global norm, an update pass); target at most 1.10x ``fused``;
* ``m4``: AdamW, batch 32 as 4 microbatches of 8; target at most 1.05 x 4 x ``micro``;
* ``micro``: AdamW, batch 8 (one microbatch's step).

Peak device bytes (the memory meter, `revtrain.memory`; an estimate on the CPU) of one metered step each:
``m4`` against ``micro`` without offload (the gradient buffers of every layer stay on the device: reported
apart) and with offload; and ``m4`` + clip with offload at depth 8 against depth 32 (target at most 1.1x).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

try:
    import revtrain  # noqa: F401
except ImportError:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import gin  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import revtrain.registry  # noqa: E402,F401
from revtrain.data import byte_lm, pipeline  # noqa: E402
from revtrain.ginconfig import include_search_path  # noqa: E402
from revtrain.memory import MemoryMeter  # noqa: E402
from revtrain.models.compose import ComposedModel  # noqa: E402
from revtrain.placement import global_batch, make_mesh  # noqa: E402
from revtrain.trainers import ReversibleTrainer  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent


def _model(depth: int):
    gin.clear_config()
    with include_search_path():  # includes relative to the including file (no "Path not found" lines)
        gin.parse_config_files_and_bindings([str(REPO / "configs" / "enwik_modern.gin")], [f"NUM_LAYERS = {depth}"])
    model = ComposedModel(seed=0, d_model=128, input_key="inputs", sequence_length=128)
    gin.clear_config()
    return model


def _tx(clip: bool):
    adamw = optax.adamw(1e-3, weight_decay=0.01)
    return optax.chain(optax.clip_by_global_norm(1.0), adamw) if clip else adamw


def _batches(size: int, n: int) -> list:
    builder = byte_lm.load_byte_lm(byte_lm.GENSIM_SOURCE, 128, byte_lm.default_data_dir())
    it = iter(pipeline.train_dataset(builder, batch_size=size, seed=0))
    return [next(it) for _ in range(n)]


CONFIGS = {"fused": (32, False, 1), "clip": (32, True, 1), "m4": (32, False, 4), "micro": (8, False, 1)}


def _ready(ts, m):
    jax.block_until_ready((ts.held(), m))


def timing(rounds: int) -> dict:
    mesh = make_mesh()
    batches = {size: [global_batch(b, mesh) for b in _batches(size, 4)] for size in (8, 32)}
    trainers, states = {}, {}
    for name, (size, clip, m) in CONFIGS.items():
        trainers[name] = ReversibleTrainer(_model(6), _tx(clip), mesh, seed=0, microbatches=m)
        ts = trainers[name].init()
        for b in batches[size][:2]:  # compile, then one warm step
            ts, metrics = trainers[name].train_step(ts, b)
            _ready(ts, metrics)
        states[name] = ts
    times = {name: [] for name in CONFIGS}
    for r in range(rounds):
        for name, (size, _, _) in CONFIGS.items():
            t0 = time.perf_counter()
            states[name], metrics = trainers[name].train_step(states[name], batches[size][r % 4])
            _ready(states[name], metrics)
            times[name].append(time.perf_counter() - t0)
    step = {name: statistics.median(t) for name, t in times.items()}
    return {"step_s": step, "clip_over_fused": step["clip"] / step["fused"],
            "m4_over_4_micro": step["m4"] / (4 * step["micro"]), "rounds": rounds,
            "deferred": {name: trainers[name].deferred for name in CONFIGS}}


def peak(depth: int, size: int, clip: bool, m: int, offload: bool) -> dict:
    mesh = make_mesh()
    trainer = ReversibleTrainer(_model(depth), _tx(clip), mesh, seed=0, microbatches=m, offload=offload)
    trainer.meter = meter = MemoryMeter()
    batches = [global_batch(b, mesh) for b in _batches(size, 2)]
    ts, metrics = trainer.train_step(trainer.init(), batches[0])
    _ready(ts, metrics)
    meter.start()
    ts, metrics = trainer.train_step(ts, batches[1])
    _ready(ts, metrics)
    out = {"peak_device_bytes": meter.stop(), "method": meter.method}
    if trainer.deferred:
        out["gradient_buffer_bytes"] = sum(x.nbytes for x in jax.tree.leaves(trainer.deferred_update.buffers))
        out["gradient_buffer_memory_kind"] = jax.tree.leaves(trainer.deferred_update.buffers)[0].sharding.memory_kind
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench_recipe.json")
    args = parser.parse_args()
    out = {"timing": timing(args.rounds), "memory": {
        "micro_batch8": peak(6, 8, False, 1, False),
        "m4_batch32": peak(6, 32, False, 4, False),
        "micro_batch8_offload": peak(6, 8, False, 1, True),
        "m4_batch32_offload": peak(6, 32, False, 4, True),
        "m4_clip_offload_depth8": peak(8, 32, True, 4, True),
        "m4_clip_offload_depth32": peak(32, 32, True, 4, True)}}
    mem = out["memory"]
    out["ratios"] = {
        "clip_over_fused_time": out["timing"]["clip_over_fused"],
        "m4_over_4_micro_time": out["timing"]["m4_over_4_micro"],
        "m4_over_micro_peak": mem["m4_batch32"]["peak_device_bytes"] / mem["micro_batch8"]["peak_device_bytes"],
        "m4_over_micro_peak_less_gradients": (mem["m4_batch32"]["peak_device_bytes"]
                                              - mem["m4_batch32"]["gradient_buffer_bytes"])
        / mem["micro_batch8"]["peak_device_bytes"],
        "m4_over_micro_peak_offload": mem["m4_batch32_offload"]["peak_device_bytes"]
        / mem["micro_batch8_offload"]["peak_device_bytes"],
        "depth32_over_depth8_peak_offload": mem["m4_clip_offload_depth32"]["peak_device_bytes"]
        / mem["m4_clip_offload_depth8"]["peak_device_bytes"]}
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1))
    t = out["timing"]["step_s"]
    print("| configuration | step time (s) |\n|---|---|")
    for name in CONFIGS:
        print(f"| {name} | {t[name]:.3f} |")
    print("\n| peak device memory | MiB |\n|---|---|")
    for name, rec in mem.items():
        print(f"| {name} | {rec['peak_device_bytes'] / 2**20:.1f} |")
    print()
    for name, value in out["ratios"].items():
        print(f"{name}: {value:.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
