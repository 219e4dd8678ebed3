"""A large Llama-shaped model trained with its state in host memory, in this process (for scripts/gpu_report.sh):
a few steps of ReversibleTrainer + offload, no checkpoint, no evaluation; one JSON line out.

The point of issue 61: a Llama-2-7B shape (d_model 4096, 32 blocks, 32 query and 32 key-value heads, SwiGLU
11008, bytes: 6,478,368,768 parameters; AdamW float32: 77.7 GB = 72.4 GiB of weights and moments in host
memory) on a device capped at 24 GB (the caller sets ``XLA_PYTHON_CLIENT_MEM_FRACTION`` from the device's own
``bytes_limit``: scripts/gpu_report.sh), batch 32 x 1024, ``--steps`` steps, no checkpoint. Its blocks are the
exact form (``LlamaModel.form = "exact"``: reversible, nothing kept per block; the standard form would keep 32
block inputs of 0.5 GiB each in pinned memory). Each layer's initial values are made by its lazy factory,
eagerly on the default device (the GPU), one layer at a time, and placed in pinned host memory (a GPU has no
pageable host kind): before JAX's backend starts, the state's bytes are counted from shapes and XLA's pinned
pool is preallocated at that size (`revtrain.pinned.train_environment`, as ``revtrain train`` does; 76 GiB,
over XLA's default cap of 64). The record holds the parameters, the pool's setting, the host's peak resident
bytes (``VmHWM``, after init and at the end) and bytes per parameter, the device's allocator peak
(``peak_bytes_in_use``), the init time, tokens/s (median of the steps after the first, which compiles) and
the model FLOP utilization ``6 x parameters x tokens/s / --peak_flops`` (989 TFLOP/s: an H100 SXM's dense
bfloat16 peak; an H200's is the same). A failure is a record too (``status`` ``"out of memory"`` or
``"error"`` with the first line of the error).

  python scripts/bench_large.py                      (the 6.48 B point)
  python scripts/bench_large.py --d_model 64 --num_layers 2 --num_heads 4 --num_kv_heads 2 --d_ff 128 \\
      --batch 2 --seq 64                             (a CPU check of the script)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import bench_common as common

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from revtrain import pinned  # noqa: E402

from revtrain.memory import host_resident  # noqa: E402
from revtrain.models.llama import LlamaModel  # noqa: E402
from revtrain.placement import make_mesh  # noqa: E402
from revtrain.trainers import ReversibleTrainer  # noqa: E402


def _model(args):
    return LlamaModel(None, sequence_length=args.seq, d_model=args.d_model, num_layers=args.num_layers,
                      num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, d_ff=args.d_ff,
                      compute_dtype=args.compute_dtype, form=args.form)


def pinned_need(args, tx) -> int:
    """The host tier's pinned bytes from shapes, before the backend starts (the model built under
    ``jax.eval_shape``): every layer's weights and AdamW state, and the largest layer once more (written back
    beside its old copy)."""
    box = []
    jax.eval_shape(lambda: box.append(_model(args).param_shapes()) or ())
    nbytes = lambda t: sum(int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize  # noqa: E731
                           for x in jax.tree.leaves(t))
    layers = [nbytes(p) + nbytes(jax.eval_shape(tx.init, p)) for p in box[0]]
    return sum(layers) + max(layers)


def run(args) -> dict:
    """The point's record (see the module note)."""
    tx = optax.adamw(1e-4)
    need = pinned_need(args, tx)
    chosen, refusal = pinned.train_environment(need)  # (before the backend starts: XLA reads them then)
    device = jax.devices()[0]
    rec = {"d_model": args.d_model, "num_layers": args.num_layers, "num_heads": args.num_heads,
           "num_kv_heads": args.num_kv_heads, "d_ff": args.d_ff, "batch": args.batch, "seq": args.seq,
           "steps": args.steps, "compute_dtype": args.compute_dtype, "trainer": "ReversibleTrainer + offload",
           "optimizer": "AdamW float32", "platform": device.platform, "device_kind": device.device_kind,
           "form": args.form, "pinned_need_bytes": need, "pinned_env_set": chosen,
           "pinned_pool": pinned.limit()[1]}
    if refusal:
        rec.update(status="error", error=refusal)
        return rec
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        rec["device_bytes_limit"] = int(stats["bytes_limit"])
    try:
        mesh = make_mesh()
        model = _model(args)
        params = model.num_params()
        rec["num_params"] = params
        rec["state_bytes"] = 12 * params  # (AdamW float32: weights and two moments)
        trainer = ReversibleTrainer(model, tx, mesh, seed=0, offload=True)
        rec["state_memory_kind"] = trainer.residency.memory_kind
        rec["memory_line"] = trainer.residency.memory_line
        t0 = time.perf_counter()
        ts = trainer.init()
        jax.block_until_ready(ts.held())
        rec["init_s"] = round(time.perf_counter() - t0, 2)
        rec["init_host_peak_bytes"] = host_resident()[1]
        batches = common.batches(args.seq, args.batch, min(args.steps, 2), mesh)
        times = []
        for i in range(args.steps):
            t0 = time.perf_counter()
            ts, m = trainer.train_step(ts, batches[i % len(batches)])
            common.ready(ts, m)
            times.append(time.perf_counter() - t0)
        step = statistics.median(times[1:] or times)
        tps = args.batch * args.seq / step
        host_peak = host_resident()[1]
        rec.update(status="ok", loss=float(m["loss"]), step_s_all=[round(t, 3) for t in times], step_s=round(step, 3),
                   tokens_per_sec=tps, mfu=6 * params * tps / args.peak_flops, host_peak_bytes=host_peak,
                   host_bytes_per_param=round(host_peak / params, 2))
        after = device.memory_stats() or {}
        if "peak_bytes_in_use" in after:
            rec["peak_device_bytes"] = int(after["peak_bytes_in_use"])
    except Exception as e:  # noqa: BLE001 (the record says what happened; out of memory is a result here)
        text = f"{type(e).__name__}: {e}"
        oom = "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
        rec.update(status="out of memory" if oom else "error", error=text.splitlines()[0][:300],
                   host_peak_bytes=host_resident()[1])
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d_model", type=int, default=4096)
    p.add_argument("--num_layers", type=int, default=32)
    p.add_argument("--num_heads", type=int, default=32)
    p.add_argument("--num_kv_heads", type=int, default=32)
    p.add_argument("--d_ff", type=int, default=11008)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3, help="steps (the first compiles; tokens/s from the others)")
    p.add_argument("--compute_dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--form", default="exact", choices=("exact", "standard"), help="LlamaModel.form")
    p.add_argument("--peak_flops", type=float, default=989e12, help="the device's peak FLOP/s for the MFU")
    print(json.dumps(run(p.parse_args())), flush=True)


if __name__ == "__main__":
    main()
