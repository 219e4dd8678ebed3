"""Memory and speed of StandardTrainer vs ReversibleTrainer (with and without offload) against depth.

  python scripts/benchmark.py [--depths 2,4,8,16,32] [--d_model 256] [--seq 512] [--batch 8]
                              [--steps 3] [--out bench.json] [--plot bench.png]

For each depth the three trainers are built on the same model and the same real batches (the English-
Wikipedia excerpt), warmed up (compilation), then timed in interleaved rounds (one step of each trainer per
round, so machine noise hits all three alike); tokens/s is the median over rounds. Peak device bytes come
from the memory meter (``revtrain.memory``): the allocator's peak on GPU/TPU (measured in a fresh
subprocess per configuration, since that peak cannot be reset), the live-array + compiled-temp estimate on
CPU. Writes ``bench.json`` (one record per trainer x depth), a PNG plot, and prints a table.
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

import jax  # noqa: E402
import optax  # noqa: E402

from revtrain.data import byte_lm, pipeline  # noqa: E402
from revtrain.memory import MemoryMeter  # noqa: E402
from revtrain.models import ReversibleTransformerLM  # noqa: E402
from revtrain.placement import global_batch, make_mesh  # noqa: E402
from revtrain.trainers import ReversibleTrainer, StandardTrainer  # noqa: E402

CONFIGS = [("standard", False), ("reversible", False), ("reversible", True)]


def _trainer(kind, offload, depth, args, mesh):
    model = ReversibleTransformerLM(args.seq, num_layers=depth, d_model=args.d_model, num_heads=args.heads,
                                    dropout_rate=0.0)
    tx = optax.adam(1e-4)
    if kind == "standard":
        return StandardTrainer(model, tx, mesh, seed=0)
    return ReversibleTrainer(model, tx, mesh, seed=0, offload=offload)


def _batches(args, n):
    builder = byte_lm.load_byte_lm(byte_lm.GENSIM_SOURCE, args.seq, byte_lm.default_data_dir())
    it = iter(pipeline.train_dataset(builder, batch_size=args.batch, seed=0))
    return [next(it) for _ in range(n)]


def measure_memory(kind, offload, depth, args) -> tuple[int, str]:
    """Peak device bytes of one step after a warm-up step, in this process."""
    mesh = make_mesh()
    trainer = _trainer(kind, offload, depth, args, mesh)
    meter = MemoryMeter()
    trainer.meter = meter
    ts = trainer.init()
    batches = [global_batch(b, mesh) for b in _batches(args, 2)]
    ts, m = trainer.train_step(ts, batches[0])
    jax.block_until_ready(m)
    meter.start()
    ts, m = trainer.train_step(ts, batches[1])
    jax.block_until_ready((ts.params, m))
    return meter.stop(), meter.method


def _memory_in_subprocess(kind, offload, depth, args) -> tuple[int, str]:
    cmd = [sys.executable, __file__, "--memory_only", f"{kind},{int(offload)},{depth}", "--d_model",
           str(args.d_model), "--seq", str(args.seq), "--batch", str(args.batch), "--heads", str(args.heads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    peak, method = out.split()
    return int(peak), method


def run(args) -> list[dict]:
    mesh = make_mesh()
    on_cpu = jax.devices()[0].platform == "cpu"
    batches = [global_batch(b, mesh) for b in _batches(args, args.warmup + args.steps)]
    tokens = args.batch * args.seq
    records = []
    for depth in args.depths:
        trainers, states = {}, {}
        for kind, offload in CONFIGS:
            t = _trainer(kind, offload, depth, args, mesh)
            ts = t.init()
            for b in batches[: args.warmup]:
                ts, m = t.train_step(ts, b)
            jax.block_until_ready((ts.params, m))
            trainers[(kind, offload)], states[(kind, offload)] = t, ts
        times = {c: [] for c in CONFIGS}
        for b in batches[args.warmup:]:  # interleaved rounds
            for c in CONFIGS:
                t0 = time.perf_counter()
                states[c], m = trainers[c].train_step(states[c], b)
                jax.block_until_ready((states[c].params, m))
                times[c].append(time.perf_counter() - t0)
        del trainers, states
        base = tokens / statistics.median(times[("standard", False)])
        for kind, offload in CONFIGS:
            tps = tokens / statistics.median(times[(kind, offload)])
            if on_cpu:
                peak, method = measure_memory(kind, offload, depth, args)
            else:
                peak, method = _memory_in_subprocess(kind, offload, depth, args)
            rec = {"trainer": kind, "offload": offload, "depth": depth, "peak_device_bytes": peak,
                   "memory_method": method, "tokens_per_sec": tps, "ratio_to_standard": tps / base,
                   "platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind,
                   "d_model": args.d_model, "seq": args.seq, "batch": args.batch}
            records.append(rec)
            print(f"depth {depth:>3} {kind:>10}{' +offload' if offload else '         '} "
                  f"peak {peak / 2**20:9.1f} MiB  {tps:10,.0f} tok/s  x{tps / base:.2f}", flush=True)
    return records


def table(records) -> str:
    lines = ["| depth | trainer | peak device MiB | tokens/s | ratio to standard |", "|---|---|---|---|---|"]
    for r in records:
        name = r["trainer"] + (" + offload" if r["offload"] else "")
        lines.append(f"| {r['depth']} | {name} | {r['peak_device_bytes'] / 2**20:.1f} | "
                     f"{r['tokens_per_sec']:,.0f} | {r['ratio_to_standard']:.2f} |")
    return "\n".join(lines)


def plot(records, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for kind, offload in CONFIGS:
        rs = [r for r in records if r["trainer"] == kind and r["offload"] == offload]
        label = kind + (" + offload" if offload else "")
        a.plot([r["depth"] for r in rs], [r["peak_device_bytes"] / 2**20 for r in rs], "o-", label=label)
        b.plot([r["depth"] for r in rs], [r["tokens_per_sec"] for r in rs], "o-", label=label)
    r0 = records[0]
    title = f"{r0['device_kind']} ({r0['memory_method']}), d_model {r0['d_model']}, seq {r0['seq']}, batch {r0['batch']}"
    for ax, ylabel in ((a, "peak device memory (MiB)"), (b, "tokens / s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("depth (reversible blocks)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depths", default="2,4,8,16,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="bench.json")
    p.add_argument("--plot", default="bench.png")
    p.add_argument("--memory_only", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.memory_only:
        kind, offload, depth = args.memory_only.split(",")
        peak, method = measure_memory(kind, bool(int(offload)), int(depth), args)
        print(peak, method)
        return
    records = run(args)
    pathlib.Path(args.out).write_text(json.dumps(records, indent=1) + "\n")
    plot(records, args.plot)
    print(table(records))
    print(f"wrote {os.path.abspath(args.out)} and {os.path.abspath(args.plot)}")


if __name__ == "__main__":
    main()
