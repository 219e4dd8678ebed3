"""Peak device memory against depth of a Llama-style model of standard blocks, three ways.

  python scripts/bench_exact.py [--depths 8,32] [--gamma 0.125] [--out docs/bench_exact.json]

Each configuration runs in its own process: a `LlamaModel` (d_model 64, 4 heads, 2 key/value heads, d_ff 192,
random bytes as tokens, batch 8 x 128, Adam), one warm-up step, then one measured step with the memory meter
(`revtrain.memory.MemoryMeter`: the allocator's peak on GPU/TPU, the live-array + compiled-temporaries
estimate on the CPU):

* ``standard``: StandardTrainer (scanned layers), form 'standard' (ordinary backprop);
* ``saved_inputs``: ReversibleTrainer with offload, form 'standard' (each block's input saved in host memory);
* ``exact``: ReversibleTrainer with offload, form 'exact' (BDIA blocks, ``LlamaModel.gamma`` ``--gamma``, the
  model's default unless given; the side bits, ``-log2 gamma`` per element per block, ride with the
  activation on the device).

Host bytes of saved activations are counted from the forward's shapes: the inputs of the standard layers
(what the reversible trainer keeps in host memory with offload).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

KINDS = ("standard", "saved_inputs", "exact")
SIZES = dict(vocab_size=256, d_model=64, num_heads=4, num_kv_heads=2, d_ff=192)
BATCH, T = 8, 128


def one(kind: str, depth: int, gamma: float | None = None) -> dict:
    import jax
    import numpy as np
    import optax

    from revtrain.memory import MemoryMeter
    from revtrain.models.llama import LlamaModel
    from revtrain.placement import global_batch, make_mesh
    from revtrain.trainers.reversible import ReversibleTrainer
    from revtrain.trainers.standard import StandardTrainer

    form = "exact" if kind == "exact" else "standard"
    extra = {"gamma": gamma} if gamma is not None and form == "exact" else {}
    model = LlamaModel(None, sequence_length=T, form=form, num_layers=depth, **SIZES, **extra)
    mesh = make_mesh(jax.devices()[:1])
    if kind == "standard":
        trainer = StandardTrainer(model, optax.adam(1e-3), mesh, scan_layers=True)
    else:
        trainer = ReversibleTrainer(model, optax.adam(1e-3), mesh, offload=True)
    rng = np.random.RandomState(0)

    def batch():
        return global_batch({"inputs": rng.randint(0, 256, (BATCH, T)).astype(np.int32),
                             "targets": rng.randint(0, 256, (BATCH, T)).astype(np.int32)}, mesh)

    # Host bytes of saved activations: the inputs of the standard layers (the head excepted).
    params, states = model.param_shapes(), model.state_shapes()  # shapes only: no weight is made here
    x = jax.ShapeDtypeStruct((BATCH, T), np.int32)
    saved = 0
    for i, layer in enumerate(model.layers[:-1]):
        if not layer.reversible:
            saved += sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(x))
        x = jax.eval_shape(lambda p, s, x, layer=layer: layer.apply(p, s, x, None, False)[0], params[i], states[i], x)
    side = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(x) if a.dtype == np.uint8)
    meter = MemoryMeter()
    trainer.meter = meter
    ts = trainer.init()
    ts, m = trainer.train_step(ts, batch())
    jax.block_until_ready(m)
    meter.start()
    ts, m = trainer.train_step(ts, batch())
    jax.block_until_ready((ts.params, m))
    return {"kind": kind, "depth": depth, "peak_bytes": meter.stop(), "method": meter.method,
            "saved_activation_bytes": saved if kind != "standard" else None, "side_bits_bytes": side,
            "stream_bytes": BATCH * T * SIZES["d_model"] * 4, "loss": float(m["loss"])}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--depths", default="8,32")
    p.add_argument("--gamma", type=float, default=None, help="the exact form's |g| (default: LlamaModel's)")
    p.add_argument("--out", default=None)
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        kind, depth = args.one.split(",")
        print(json.dumps(one(kind, int(depth), args.gamma)))
        return
    rows = []
    for depth in [int(d) for d in args.depths.split(",")]:
        for kind in KINDS:
            out = subprocess.run([sys.executable, __file__, "--one", f"{kind},{depth}"]
                                 + ([] if args.gamma is None else ["--gamma", str(args.gamma)]), check=True,
                                 capture_output=True, text=True).stdout.strip().splitlines()[-1]
            row = json.loads(out)
            rows.append(row)
            print(f"depth {depth:>3} {kind:<13} peak {row['peak_bytes'] / 2**20:8.2f} MiB ({row['method']}); "
                  f"saved activations {row['saved_activation_bytes']}; side bits {row['side_bits_bytes']}",
                  flush=True)
    record = {"sizes": SIZES, "batch": BATCH, "sequence_length": T, "rows": rows,
              "load_average": list(os.getloadavg())}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
