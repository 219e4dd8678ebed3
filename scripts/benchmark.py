"""Memory and speed of StandardTrainer vs ReversibleTrainer (with and without offload) against depth.

  python scripts/benchmark.py [--depths 2,4,8,16,32] [--d_model 256] [--seq 512] [--batch 8]
                              [--steps 3] [--out bench.json] [--plot bench.png]
  python scripts/benchmark.py --sweep depth [--out bench_depth.json] [--plot bench_depth.png]

``--sweep depth`` (``make bench-depth``): steps/s and start-up time of tiny blocks at depths 8..256 for
both executors of both trainers, the cost of a logged step (memory meter on), and offload against no
offload at d_model 64-256; see ``depth_sweep``.

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


# -- the depth sweep (--sweep depth) -------------------------------------------------------------------
# Each configuration: (label, trainer kind, keyword arguments of the trainer).
DEPTH_CONFIGS = [
    ("reversible, per layer", "reversible", {"scan_layers": False}),
    ("reversible, scan", "reversible", {"scan_layers": True}),
    ("reversible, scan + offload", "reversible", {"scan_layers": True, "offload": True}),
    ("standard, unrolled", "standard", {"scan_layers": False}),
    ("standard, scan", "standard", {"scan_layers": True}),
]
OFFLOAD_CONFIGS = [
    ("reversible, per layer", "reversible", {"scan_layers": False}),
    ("reversible, per layer + offload", "reversible", {"scan_layers": False, "offload": True}),
    ("reversible, scan", "reversible", {"scan_layers": True}),
    ("reversible, scan + offload", "reversible", {"scan_layers": True, "offload": True}),
]


def _depth_trainer(kind, kwargs, depth, d_model, heads, seq, mesh):
    model = ReversibleTransformerLM(seq, num_layers=depth, d_model=d_model, num_heads=heads, dropout_rate=0.1)
    cls = StandardTrainer if kind == "standard" else ReversibleTrainer
    return cls(model, optax.adam(1e-4), mesh, seed=0, **kwargs)


def _sweep_batches(seq, batch, n):
    """``n`` real batches of ``seq`` bytes (the first ``seq`` bytes of the prepared 128-byte examples)."""
    builder = byte_lm.load_byte_lm(byte_lm.GENSIM_SOURCE, 128, byte_lm.default_data_dir())
    it = iter(pipeline.train_dataset(builder, batch_size=batch, seed=0))
    return [{k: v[:, :seq] for k, v in next(it).items()} for _ in range(n)]


def _timed_rounds(configs, trainers, states, batches, rounds, logged):
    """Interleaved rounds (one step of each configuration per round); returns per-config step times (s).
    ``logged``: the memory meter measures every step, as on a logged step of the train loop."""
    times = {c: [] for c in configs}
    for r in range(rounds):
        b = batches[r % len(batches)]
        for c in configs:
            t = trainers[c]
            if logged:
                t.meter.start()
            t0 = time.perf_counter()
            states[c], m = t.train_step(states[c], b)
            jax.block_until_ready(m)
            if logged:
                t.meter.stop()
            times[c].append(time.perf_counter() - t0)
    return times


def _measure(configs, build, batches, rounds):
    """Builds each configuration, times its first step (start-up: tracing, compilation, first run) and
    its steady state (unlogged and logged, interleaved with the others). Returns records by config."""
    trainers, states, out = {}, {}, {}
    for c in configs:
        t0 = time.perf_counter()
        trainer = build(c)
        ts = trainer.init()
        ts, m = trainer.train_step(ts, batches[0])
        jax.block_until_ready(m)
        startup = time.perf_counter() - t0
        trainer.meter = MemoryMeter()
        trainer.meter.start()  # the meter's first look at each program compiles it for memory_analysis
        ts, m = trainer.train_step(ts, batches[1 % len(batches)])
        jax.block_until_ready(m)
        trainer.meter.stop()
        trainers[c], states[c] = trainer, ts
        out[c] = {"startup_s": startup}
    plain = _timed_rounds(configs, trainers, states, batches, rounds, logged=False)
    logged = _timed_rounds(configs, trainers, states, batches, max(2, rounds // 2), logged=True)
    for c in configs:
        step = statistics.median(plain[c])
        out[c].update(step_s=step, steps_per_sec=1.0 / step,
                      logged_over_unlogged=statistics.median(logged[c]) / step)
    return out


def depth_sweep(args) -> dict:
    """Tiny blocks (d_model 16, 2 heads, batch 4, sequence 32, dropout 0.1, Adam) at ``args.depths``.

    For each depth, every configuration of ``DEPTH_CONFIGS`` is built and stepped once (start-up time),
    then timed in interleaved rounds (median step time), unlogged and with the memory meter on. A
    configuration whose start-up time, scaled linearly to the next depth, would pass
    ``args.max_startup`` seconds is skipped from there on (recorded with the reason). Then offload
    against no offload at ``args.offload_widths`` (depth ``args.offload_depth``).
    """
    mesh = make_mesh()
    records, skipped, last_startup = [], {}, {}
    batches = [global_batch(b, mesh) for b in _sweep_batches(args.sweep_seq, args.sweep_batch, 4)]
    for depth in args.depths:
        configs = []
        for label, kind, kwargs in DEPTH_CONFIGS:
            prev = last_startup.get(label)
            if label in skipped:
                continue
            if prev and prev[1] * depth / prev[0] > args.max_startup:
                skipped[label] = (f"skipped from depth {depth}: start-up {prev[1]:.0f} s at depth {prev[0]} "
                                  f"scales past {args.max_startup:.0f} s")
                print(f"{label}: {skipped[label]}", flush=True)
                continue
            configs.append((label, kind, tuple(sorted(kwargs.items()))))
        res = _measure(configs, lambda c: _depth_trainer(c[1], dict(c[2]), depth, 16, 2, args.sweep_seq, mesh),
                       batches, args.rounds)
        for c in configs:
            r = res[c]
            last_startup[c[0]] = (depth, r["startup_s"])
            records.append({"sweep": "depth", "config": c[0], "depth": depth, "d_model": 16, **r})
            print(f"depth {depth:>3} {c[0]:<28} start-up {r['startup_s']:7.1f} s  {r['steps_per_sec']:8.2f} "
                  f"steps/s  logged/unlogged {r['logged_over_unlogged']:.2f}", flush=True)
    offload = []
    for width in args.offload_widths:
        heads = 2 if width < 64 else 4
        configs = [(label, kind, tuple(sorted(kwargs.items()))) for label, kind, kwargs in OFFLOAD_CONFIGS]
        res = _measure(configs, lambda c: _depth_trainer(c[1], dict(c[2]), args.offload_depth, width, heads,
                                                           args.sweep_seq, mesh), batches, args.rounds)
        for c in configs:
            r = res[c]
            base = res[next(k for k in configs if k[0] == c[0].replace(" + offload", ""))]["steps_per_sec"]
            offload.append({"sweep": "offload", "config": c[0], "depth": args.offload_depth, "d_model": width,
                            "ratio_to_no_offload": r["steps_per_sec"] / base, **r})
            print(f"d_model {width:>3} {c[0]:<32} {r['steps_per_sec']:8.2f} steps/s  x{r['steps_per_sec'] / base:.2f} "
                  "of no offload", flush=True)
    platform = {"platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind,
                "devices": len(jax.devices()), "seq": args.sweep_seq, "batch": args.sweep_batch}
    return {"depth": records, "offload": offload, "skipped": skipped, **platform}


def depth_table(result) -> str:
    """The README table of the depth sweep: steps/s and start-up time against depth, per configuration."""
    depths = sorted({r["depth"] for r in result["depth"]})
    labels = [label for label, _, _ in DEPTH_CONFIGS]
    lines = ["| configuration | " + " | ".join(f"depth {d}" for d in depths) + " |",
             "|---|" + "---|" * len(depths)]
    by = {(r["config"], r["depth"]): r for r in result["depth"]}
    for label in labels:
        cells = []
        for d in depths:
            r = by.get((label, d))
            cells.append(f"{r['steps_per_sec']:.2f} steps/s, {r['startup_s']:.0f} s" if r else "skipped")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "| configuration | d_model | steps/s | ratio to no offload |", "|---|---|---|---|"]
    for r in result["offload"]:
        lines.append(f"| {r['config']} | {r['d_model']} | {r['steps_per_sec']:.2f} | {r['ratio_to_no_offload']:.2f} |")
    return "\n".join(lines)


def depth_plot(result, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for label, _, _ in DEPTH_CONFIGS:
        rs = [r for r in result["depth"] if r["config"] == label]
        if rs:
            a.plot([r["depth"] for r in rs], [r["steps_per_sec"] for r in rs], "o-", label=label)
            b.plot([r["depth"] for r in rs], [r["startup_s"] for r in rs], "o-", label=label)
    for ax, ylabel in ((a, "steps / s"), (b, "start-up (first step incl. compile), s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("depth (reversible blocks)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['device_kind']}: d_model 16, 2 heads, batch {result['batch']}, sequence {result['seq']}")
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
    p.add_argument("--sweep", choices=["depth"], help="run a sweep instead of the memory/speed benchmark")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per configuration (sweeps)")
    p.add_argument("--max_startup", type=float, default=600.0,
                   help="skip a sweep configuration once its start-up time would pass this many seconds")
    p.add_argument("--sweep_seq", type=int, default=32)
    p.add_argument("--sweep_batch", type=int, default=4)
    p.add_argument("--offload_widths", default="64,128,256", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--offload_depth", type=int, default=8)
    args = p.parse_args()
    if args.sweep == "depth":
        if "--depths" not in sys.argv:
            args.depths = [8, 32, 64, 128, 256]
        out = args.out if "--out" in sys.argv else "bench_depth.json"
        png = args.plot if "--plot" in sys.argv else "bench_depth.png"
        result = depth_sweep(args)
        pathlib.Path(out).write_text(json.dumps(result, indent=1) + "\n")
        depth_plot(result, png)
        print(depth_table(result))
        print(f"wrote {os.path.abspath(out)} and {os.path.abspath(png)}")
        return
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
