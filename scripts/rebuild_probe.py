"""Rebuild error of the trainer's own programs on a run's checkpoint, in either executor, with or without
offload (the evidence behind docs/rebuild.md's table of executors).

``revtrain check`` measures the rebuild with per-layer programs of its own; this script runs the
``ReversibleTrainer``'s compiled programs themselves (`ReversibleTrainer._plan`: the per-layer programs, or
one ``lax.scan`` per run of identical blocks with ``scan_layers``), as ``train_step`` calls them, on one
real batch from the checkpoint's weights: it records every group's forward input, runs the head and the
backward walk, and compares each group's rebuilt input with the input its forward saw, bit for bit
(``max |x_rebuilt - x| / max |x|`` over both streams; for a scanned run, the rebuilt input of its bottom
block, which carries every block's error). No optimizer update is kept.

Usage: python scripts/rebuild_probe.py --workdir runs/enwik_small [--step N] [--gin BINDING ...]
  e.g. --gin "ReversibleTrainer.scan_layers = True" --gin "ReversibleTrainer.offload = True"
       --gin "ReversibleTransformerLM.compute_dtype = 'bfloat16'" --gin "ReversibleTrainer.rebuild = 'exact'"
Prints one line per reversible group and one summary line (``worst``).
"""

from __future__ import annotations

import argparse
import os

import gin
import jax
import numpy as np


def _rel(a, b) -> float:
    a = [np.asarray(x, np.float64) for x in jax.tree.leaves(a)]
    b = [np.asarray(x, np.float64) for x in jax.tree.leaves(b)]
    scale = max(float(np.abs(x).max()) for x in a)
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b)) / scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--gin", action="append", default=[])
    args = parser.parse_args()
    jax.config.update("jax_default_matmul_precision", "highest")  # as revtrain check
    from revtrain import checkpoint as ckpt_lib
    from revtrain import loop, registry  # noqa: F401  (registry registers the configurables)
    from revtrain.placement import global_batch
    from revtrain.trainers.common import step_key

    gin.parse_config_files_and_bindings([os.path.join(args.workdir, "config.gin")], args.gin)
    run = loop.build()
    trainer, cfg = run.trainer, run.cfg
    checkpointer = ckpt_lib.Checkpointer(args.workdir, read_only=True)
    try:
        ts, step = checkpointer.restore_newest(trainer.abstract_state(), args.step)  # restored into place, no init
    finally:
        checkpointer.close()
    batch = global_batch(next(run.task.train_iterator(cfg.batch_size, cfg.seed, 0, 1)), run.mesh)
    grouped = trainer._working(ts)
    plan = trainer._plan(grouped.groups)
    kinds, index, last = plan.kinds, plan.index, len(plan.kinds) - 1
    assert "top" not in kinds, "fuse_top: the top block is not rebuilt"
    skey = step_key(trainer.seed, ts.step)
    params, opt, states = list(grouped.params), list(grouped.opt_state), grouped.layer_state
    seen, saved = {}, {}
    x = batch[run.model.input_key]
    for g in range(last):
        if kinds[g] == "std":
            saved[g] = trainer.residency.keep(x)
        else:
            seen[g] = jax.tree.map(np.array, x)  # a copy: the forward donates x
        x, _ = plan.forward[g](params[g], states[g], x, skey, index[g])
    dy, *_ = plan.head(params[last], opt[last], states[last], x, batch, skey, index[last])
    y, worst = x, 0.0
    for g in range(last - 1, -1, -1):
        if kinds[g] == "std":
            xs = trainer.residency.bring(saved.pop(g))
            dy, *_ = plan.backward[g](params[g], opt[g], states[g], xs, dy, skey, index[g])
            y = xs
            continue
        # params/opt are donated by the backward programs: give copies.
        p, o = jax.tree.map(lambda a: a.copy(), (params[g], opt[g]))
        y, dy, *_ = plan.backward[g](p, o, states[g], y, dy, skey, index[g])
        err = _rel(seen[g], y)
        worst = max(worst, err)
        start, count = grouped.groups[g]
        print(f"layers {start}..{start + count - 1} ({kinds[g]}): rebuild error of the bottom input {err:.1e}")
    print(f"worst {worst:.1e}: step {step} of {args.workdir}, rebuild '{trainer.rebuild}', scan_layers "
          f"{trainer.scan_layers}, tier {trainer.residency.name}; bindings {'; '.join(args.gin) or 'none'}")

if __name__ == "__main__":
    main()
