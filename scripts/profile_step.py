"""Where one training step's time goes: data, compiled programs (device compute), host-side Python.

  python scripts/profile_step.py [--config configs/enwik_small.gin] [--gin 'NAME = VALUE' ...] [--steps 20]

Builds the run of a gin config as ``revtrain train`` does (default: configs/enwik_small.gin), takes warm-up steps
(compilation), then measures two phases of ``--steps`` steps each on real batches:

* **as in training**: the time to fetch and place a batch (``next(data)`` + ``global_batch``), and the
  wall time of ``train_step`` (which ends with the step's one host sync, the check of non-finite values, so
  it includes all device work);
* **attributed**: every compiled call of the trainer is made to wait for its outputs and timed
  (``block_until_ready``): the sum is the time of the compiled programs, run one after another (device
  compute; on a CPU backend the "device" is the same cores); the rest of the step's wall time is the
  host's own work (Python of the layer loop, dispatch, argument handling, the final sync's bookkeeping).
  Waiting after each call removes the overlap of host and device work, so this phase's step is longer
  than the first phase's: the difference is what asynchronous dispatch hides.

Prints a table (milliseconds per step) and the number of compiled calls per step.
"""

from __future__ import annotations

import argparse
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

from revtrain import loop, registry  # noqa: E402,F401  (gin configurables)
from revtrain.placement import global_batch  # noqa: E402
from revtrain.trainers import common  # noqa: E402

DEFAULT_CONFIG = str(pathlib.Path(__file__).resolve().parent.parent / "configs" / "enwik_small.gin")


def _ready(ts, metrics) -> None:
    jax.block_until_ready((ts.held(), metrics))


def profile(steps: int, warmup: int) -> dict:
    """Measures the two phases (see the module note) on the parsed gin config; returns ms per step."""
    run = loop.build()
    cfg, trainer = run.cfg, run.trainer
    data = run.task.train_iterator(cfg.batch_size, cfg.seed, 0, 1)
    ts = trainer.init()
    for _ in range(warmup):
        ts, m = trainer.train_step(ts, global_batch(next(data), run.mesh))
    _ready(ts, m)

    fetch, wall = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = global_batch(next(data), run.mesh)
        jax.block_until_ready(batch)
        t1 = time.perf_counter()
        ts, m = trainer.train_step(ts, batch)
        _ready(ts, m)
        fetch.append(t1 - t0)
        wall.append(time.perf_counter() - t1)

    compute, calls = [0.0], [0]
    plain_call = common._Dispatch.__call__

    def timed_call(self, *args):
        t = time.perf_counter()
        out = plain_call(self, *args)
        jax.block_until_ready(out)
        compute[0] += time.perf_counter() - t
        calls[0] += 1
        return out

    attributed, programs = [], []
    common._Dispatch.__call__ = timed_call
    try:
        batches = [global_batch(next(data), run.mesh) for _ in range(steps)]
        for batch in batches:
            compute[0], calls[0] = 0.0, 0
            t = time.perf_counter()
            ts, m = trainer.train_step(ts, batch)
            _ready(ts, m)
            attributed.append(time.perf_counter() - t)
            programs.append(compute[0])
    finally:
        common._Dispatch.__call__ = plain_call
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    return {"trainer": trainer.name, "layers": len(run.model.layers), "calls_per_step": calls[0],
            "data_ms": ms(fetch), "step_ms": ms(wall), "attributed_step_ms": ms(attributed),
            "programs_ms": ms(programs), "host_ms": ms([a - p for a, p in zip(attributed, programs)])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--config", action="append", default=None, help="gin file (repeatable)")
    p.add_argument("--gin", action="append", default=[], help="gin binding (repeatable)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    gin.parse_config_files_and_bindings(args.config or [DEFAULT_CONFIG], args.gin, finalize_config=False)
    r = profile(args.steps, args.warmup)
    print(f"{r['trainer']} trainer, {r['layers']} layers, {r['calls_per_step']} compiled calls per step; "
          f"median of {args.steps} steps, ms per step:")
    print("| data (fetch + place a batch) | step, as in training | step, each call waited for | of which "
          "compiled programs | of which host-side work |")
    print("|---|---|---|---|---|")
    print(f"| {r['data_ms']:.1f} | {r['step_ms']:.1f} | {r['attributed_step_ms']:.1f} | {r['programs_ms']:.1f} | "
          f"{r['host_ms']:.1f} |")


if __name__ == "__main__":
    main()
