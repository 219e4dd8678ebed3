"""Memory and speed of StandardTrainer (plain and remat) vs ReversibleTrainer (exact and fused rebuild,
with and without offload) against depth, or of blockwise vs dense attention against the sequence length
(``--sweep seq``), or one configuration in its own process (``--sweep point``, for scripts/gpu_report.sh).

  python scripts/benchmark.py [--depths 2,4,8,16,32] [--d_model 256] [--seq 512] [--batch 8]
                              [--steps 3] [--configs 'remat;reversible fused'] [--long_depth 32]
                              [--long_seq 4096] [--long_batch 1] [--long_steps 1] [--out bench.json] [--plot bench.png]
  python scripts/benchmark.py --sweep point --point 'reversible fused + offload' --depth 4 [--d_model ...]
                              [--compute_dtype bfloat16] [--bench_attention_block 1024]
  python scripts/benchmark.py --sweep depth [--out bench_depth.json] [--plot bench_depth.png]
  python scripts/benchmark.py --sweep seq [--seqs 512,1024,4096,16384,65536] [--depth 4] [--batch 1]
                              [--attention_block 512] [--dense_max 4096] [--one_step_from 16384]
                              [--out bench_long.json] [--plot bench_long.png]

``--sweep depth`` (``make bench-depth``): steps/s and start-up time of tiny blocks at depths 8..256 for
both executors of both trainers, the cost of a logged step (memory meter on), and offload against no
offload at d_model 64-256; see ``depth_sweep``.

For each depth the trainers of ``CONFIGS`` are built on the same model and the same real batches (the
English-Wikipedia excerpt), warmed up (compilation), then timed in interleaved rounds (one step of each
trainer per round, so machine noise hits all alike); tokens/s is the median over rounds. After the depths,
an activation-dominated point (``--long_depth`` blocks at ``--long_seq`` positions, blockwise attention). Peak device bytes come
from the memory meter (``revtrain.memory``): the allocator's peak on GPU/TPU (measured in a fresh
subprocess per configuration, since that peak cannot be reset), the live-array + compiled-temp estimate on
CPU. Writes ``bench.json`` (one record per trainer x depth), a PNG plot, and prints a table.

``--sweep shard``: ReversibleTrainer with replicated against sharded state (``shard_state``), with and
without offload, on ``--shard_devices`` forced CPU devices (the script re-runs itself with
``XLA_FLAGS=--xla_force_host_platform_device_count=N``), the default model (configs/enwik_small.gin: 6
layers, d_model 128, T 128, batch 32, AdamW): tokens/s in interleaved rounds (the median), the ratio
sharded / replicated, peak device bytes (meter) and ``host_state_bytes`` per device; see ``shard_sweep``.

``--sweep seq`` (``make bench-long``): ReversibleTrainer with offload on the same model with exact blockwise
attention (plus the chunked feed-forward and head loss) and with dense attention (only up to
``--dense_max``: beyond it dense attention's ``[B, H, T, T]`` arrays do not fit a small machine), over the
sequence lengths ``--seqs``; StandardTrainer's peak from its compiled step program beside them (no run:
arguments + temporaries + non-donated outputs, from ``memory_analysis()``). Below ``--one_step_from`` each
configuration gets a warm-up step, a metered step and ``--steps`` timed steps (blockwise and dense in
interleaved rounds); from it on, one metered step whose time excludes compilation (JAX's compile-time
events). It also checks blockwise against dense at ``--exact_seq`` in float32: training losses over 5 steps
and the attention parameters' gradients. Writes ``bench_long.json``, a log-log PNG and a table.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
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
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from revtrain.data import byte_lm, pipeline  # noqa: E402
from revtrain.memory import MemoryMeter  # noqa: E402
from revtrain.models import ReversibleTransformerLM  # noqa: E402
from revtrain.placement import DATA_AXIS, global_batch, make_mesh  # noqa: E402
from revtrain.trainers import ReversibleTrainer, StandardTrainer  # noqa: E402

# The trainers of ``make bench``: (label, trainer kind, keyword arguments of the trainer). "remat" is what a
# JAX user would pick for memory without a reversible model: the standard trainer scanning its identical
# blocks under ``jax.checkpoint`` (one saved input per block, the block recomputed in the backward);
# "remat + offload" also moves each saved input to host memory (``StandardTrainer.remat_offload``).
# "exact" is the reversible trainer's default rebuild (inverse, then the vjp of the block), "fused" the
# rebuild from the vjp's own primal outputs (one forward of F and G less per block); "top fused" also runs
# the block under the head inside the head's program (``ReversibleTrainer.fuse_top``).
CONFIGS = [
    ("standard", "standard", {}),
    ("remat", "standard", {"scan_layers": True, "remat_layers": True}),
    ("remat + offload", "standard", {"scan_layers": True, "remat_layers": True, "remat_offload": True}),
    ("reversible exact", "reversible", {"rebuild": "exact"}),
    ("reversible fused", "reversible", {"rebuild": "fused"}),
    ("reversible fenced", "reversible", {"rebuild": "fenced"}),
    ("reversible exact + offload", "reversible", {"rebuild": "exact", "offload": True}),
    ("reversible fused + offload", "reversible", {"rebuild": "fused", "offload": True}),
    ("reversible fused, top fused", "reversible", {"rebuild": "fused", "fuse_top": True}),
]
_BY_LABEL = {label: (kind, kwargs) for label, kind, kwargs in CONFIGS}


def _ready(ts, metrics) -> None:
    """Blocks until a step's state and metrics are computed. Waits on the arrays the trainer holds: the
    stacked layout as it is (``ts.params`` of a stacked state would copy every slice out, each step)."""
    jax.block_until_ready((ts.held(), metrics))


def _trainer(label, depth, args, mesh, seq=None):
    """The trainer ``label`` of ``CONFIGS`` on the benchmark's LM (``seq`` positions, default ``--seq``;
    ``--attention_block`` for blockwise attention)."""
    kind, kwargs = _BY_LABEL[label]
    extra = {name: getattr(args, name) for name in ("compute_dtype", "ff_chunk", "head_chunk")
             if getattr(args, name, None) is not None and (name == "compute_dtype" or args.bench_attention_block)}
    model = ReversibleTransformerLM(seq or args.seq, num_layers=depth, d_model=args.d_model, num_heads=args.heads,
                                    dropout_rate=0.0, attention_block=getattr(args, "bench_attention_block", None),
                                    **extra)
    tx = optax.adam(1e-4)
    cls = StandardTrainer if kind == "standard" else ReversibleTrainer
    return cls(model, tx, mesh, seed=0, **kwargs)


def _batches(args, n, seq=None):
    builder = byte_lm.load_byte_lm(byte_lm.GENSIM_SOURCE, seq or args.seq, byte_lm.default_data_dir())
    it = iter(pipeline.train_dataset(builder, batch_size=args.batch, seed=0))
    return [next(it) for _ in range(n)]


def measure_memory(label, depth, args, seq=None) -> tuple[int, str]:
    """Peak device bytes of one step after a warm-up step, in this process."""
    mesh = make_mesh()
    trainer = _trainer(label, depth, args, mesh, seq)
    meter = MemoryMeter()
    trainer.meter = meter
    ts = trainer.init()
    batches = [global_batch(b, mesh) for b in _batches(args, 2, seq)]
    ts, m = trainer.train_step(ts, batches[0])
    jax.block_until_ready(m)
    meter.start()
    ts, m = trainer.train_step(ts, batches[1])
    _ready(ts, m)
    return meter.stop(), meter.method


def _memory_in_subprocess(label, depth, args, seq=None) -> tuple[int, str]:
    cmd = [sys.executable, __file__, "--memory_only", f"{label},{depth},{seq or args.seq}", "--d_model",
           str(args.d_model), "--batch", str(args.batch), "--heads", str(args.heads),
           "--bench_attention_block", str(args.bench_attention_block or 0)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    peak, method = out.split()
    return int(peak), method


def _point(args, mesh, depth, seq, warmup, steps, labels) -> list[dict]:
    """One benchmark point: every trainer of ``labels`` on the same model and batches, warmed up, then timed
    in interleaved rounds (median), then metered."""
    on_cpu = jax.devices()[0].platform == "cpu"
    batches = [global_batch(b, mesh) for b in _batches(args, warmup + steps, seq)]
    tokens = args.batch * seq
    trainers, states = {}, {}
    for label in labels:
        t = _trainer(label, depth, args, mesh, seq)
        ts = t.init()
        for b in batches[:warmup]:
            ts, m = t.train_step(ts, b)
        _ready(ts, m)
        trainers[label], states[label] = t, ts
    times = {c: [] for c in labels}
    for b in batches[warmup:]:  # interleaved rounds
        for c in labels:
            t0 = time.perf_counter()
            states[c], m = trainers[c].train_step(states[c], b)
            _ready(states[c], m)
            times[c].append(time.perf_counter() - t0)
    del trainers, states
    tps = {c: tokens / statistics.median(times[c]) for c in labels}
    records = []
    for label in labels:
        if on_cpu:
            peak, method = measure_memory(label, depth, args, seq)
        else:
            peak, method = _memory_in_subprocess(label, depth, args, seq)
        kind, kwargs = _BY_LABEL[label]
        rec = {"config": label, "trainer": kind, "offload": kwargs.get("offload", False),
               "rebuild": kwargs.get("rebuild"), "depth": depth, "peak_device_bytes": peak,
               "memory_method": method, "tokens_per_sec": tps[label],
               "ratio_to_standard": tps[label] / tps["standard"] if "standard" in tps else None,
               "ratio_to_remat": tps[label] / tps["remat"] if "remat" in tps else None,
               "ratio_to_exact": (tps[label] / tps["reversible exact"] if "reversible exact" in tps else None),
               "timed_steps": steps, "platform": jax.devices()[0].platform,
               "device_kind": jax.devices()[0].device_kind, "d_model": args.d_model, "seq": seq,
               "batch": args.batch, "attention_block": args.bench_attention_block}
        records.append(rec)
        ratios = " ".join(f"x{rec[k]:.2f} {k[9:]}" for k in ("ratio_to_standard", "ratio_to_remat", "ratio_to_exact")
                          if rec[k] is not None)
        print(f"depth {depth:>3} T {seq:>5} {label:<27} peak {peak / 2**20:9.1f} MiB  {tps[label]:10,.0f} tok/s  "
              f"{ratios}", flush=True)
    return records


def point(args) -> dict:
    """One configuration in this process (``--sweep point``, for ``scripts/gpu_report.sh``): trainer
    ``--point`` at depth ``--depth``, ``--warmup`` steps, ``--steps`` timed steps, the memory meter on the
    last. Returns one record; a step that runs out of device memory gives ``status: "out of memory"``."""
    mesh = make_mesh()
    device = jax.devices()[0]
    kind, kwargs = _BY_LABEL[args.point]
    rec = {"config": args.point, "trainer": kind, "offload": kwargs.get("offload", False),
           "rebuild": kwargs.get("rebuild"), "depth": args.depth, "d_model": args.d_model, "heads": args.heads,
           "seq": args.seq, "batch": args.batch, "compute_dtype": args.compute_dtype,
           "attention_block": args.bench_attention_block, "platform": device.platform,
           "device_kind": device.device_kind}
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        rec["device_bytes_limit"] = int(stats["bytes_limit"])
    try:
        trainer = _trainer(args.point, args.depth, args, mesh)
        # weights + Adam's two moments, float32
        rec["state_bytes"] = 3 * sum(x.nbytes for layer in trainer.model.layers for x in jax.tree.leaves(layer.init_params))
        ts = trainer.init()
        batches = [global_batch(b, mesh) for b in _batches(args, args.warmup + args.steps)]
        t0 = time.perf_counter()
        for b in batches[: args.warmup]:
            ts, m = trainer.train_step(ts, b)
        _ready(ts, m)
        rec["warmup_s"] = time.perf_counter() - t0
        trainer.meter = MemoryMeter()
        times = []
        for i, b in enumerate(batches[args.warmup:]):
            last = i == args.steps - 1
            if last:
                trainer.meter.start()
            t0 = time.perf_counter()
            ts, m = trainer.train_step(ts, b)
            _ready(ts, m)
            times.append(time.perf_counter() - t0)
            if last:
                rec["peak_device_bytes"], rec["memory_method"] = trainer.meter.stop(), trainer.meter.method
        rec.update(status="ok", loss=float(m["loss"]), timed_steps=len(times),
                   tokens_per_sec=args.batch * args.seq / statistics.median(times))
    except Exception as e:  # noqa: BLE001 (the record says what happened; out of memory is a result here)
        text = f"{type(e).__name__}: {e}"
        oom = "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
        rec.update(status="out of memory" if oom else "error", error=text.splitlines()[0][:300])
    return rec


def run(args) -> list[dict]:
    """The depth points (``--depths`` at ``--seq``; none for an empty ``--depths``), then the
    activation-dominated point (``--long_depth`` blocks at ``--long_seq`` positions, batch ``--long_batch``,
    blockwise attention, ``--long_steps`` timed steps; skipped when ``--long_seq`` is 0)."""
    mesh = make_mesh()
    labels = [label for label, _, _ in CONFIGS if not args.configs or label in args.configs]
    records = []
    for depth in args.depths:
        records += _point(args, mesh, depth, args.seq, args.warmup, args.steps, labels)
    if args.long_seq:
        batch, args.batch, args.bench_attention_block = args.batch, args.long_batch, args.long_attention_block
        records += _point(args, mesh, args.long_depth, args.long_seq, 1, args.long_steps, labels)
        args.batch, args.bench_attention_block = batch, None
    return records


def table(records) -> str:
    lines = ["| depth | T | trainer | peak device MiB | tokens/s | vs standard | vs remat | vs reversible exact |",
             "|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
    for r in records:
        lines.append(f"| {r['depth']} | {r['seq']} | {r['config']} | {r['peak_device_bytes'] / 2**20:.1f} | "
                     f"{r['tokens_per_sec']:,.0f} | {fmt(r['ratio_to_standard'])} | {fmt(r['ratio_to_remat'])} | "
                     f"{fmt(r['ratio_to_exact'])} |")
    return "\n".join(lines)


def plot(records, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    r0 = records[0]
    for label, _, _ in CONFIGS:
        rs = [r for r in records if r["config"] == label and r["seq"] == r0["seq"]]
        if not rs:
            continue
        a.plot([r["depth"] for r in rs], [r["peak_device_bytes"] / 2**20 for r in rs], "o-", label=label)
        b.plot([r["depth"] for r in rs], [r["tokens_per_sec"] for r in rs], "o-", label=label)
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
            _ready(states[c], m)
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
        _ready(ts, m)
        startup = time.perf_counter() - t0
        trainer.meter = MemoryMeter()
        trainer.meter.start()  # the meter's first look at each program compiles it for memory_analysis
        ts, m = trainer.train_step(ts, batches[1 % len(batches)])
        _ready(ts, m)
        trainer.meter.stop()
        trainers[c], states[c] = trainer, ts
        out[c] = {"startup_s": startup}
    plain = _timed_rounds(configs, trainers, states, batches, rounds, logged=False)
    logged = _timed_rounds(configs, trainers, states, batches, rounds, logged=True)
    for c in configs:
        step = statistics.median(plain[c])
        out[c].update(step_s=step, steps_per_sec=1.0 / step,
                      logged_over_unlogged=statistics.median(logged[c]) / step)
    return out


def _extrapolate(seen: list[tuple[int, float]], depth: int) -> float:
    """Start-up seconds at ``depth`` from measured ``(depth, seconds)`` pairs: ``t ~ depth ** k`` through
    the last two (``k`` at least 0), or linear in depth from a single one."""
    (d1, t1), (d0, t0) = seen[-1], (seen[-2] if len(seen) > 1 else (0, 0.0))
    if d0 <= 0 or t0 <= 0:
        return t1 * depth / d1
    k = max(0.0, math.log(t1 / t0) / math.log(d1 / d0))
    return t1 * (depth / d1) ** k


def depth_sweep(args) -> dict:
    """Tiny blocks (d_model 16, 2 heads, batch 4, sequence 32, dropout 0.1, Adam) at ``args.depths``.

    For each depth, every configuration of ``DEPTH_CONFIGS`` is built and stepped once (start-up time),
    then timed in interleaved rounds (median step time), unlogged and with the memory meter on. A
    configuration whose start-up time, extrapolated to the next depth, would pass ``args.max_startup``
    seconds is skipped from there on (recorded with the reason): extrapolated with the power of depth
    that its last two measured depths show (the scanned executor's start-up hardly grows), or linearly
    after one. Then offload against no offload at ``args.offload_widths`` (depth ``args.offload_depth``).
    """
    mesh = make_mesh()
    records, skipped, last_startup = [], {}, {}
    batches = [global_batch(b, mesh) for b in _sweep_batches(args.sweep_seq, args.sweep_batch, 4)]
    for depth in args.depths:
        configs = []
        for label, kind, kwargs in DEPTH_CONFIGS:
            seen = last_startup.get(label, [])
            if label in skipped or (args.only and label not in args.only):
                continue
            if seen and _extrapolate(seen, depth) > args.max_startup:
                d, t = seen[-1]
                skipped[label] = (f"skipped from depth {depth}: start-up {t:.0f} s at depth {d} "
                                  f"extrapolates to {_extrapolate(seen, depth):.0f} s, past {args.max_startup:.0f} s")
                print(f"{label}: {skipped[label]}", flush=True)
                continue
            configs.append((label, kind, tuple(sorted(kwargs.items()))))
        res = _measure(configs, lambda c: _depth_trainer(c[1], dict(c[2]), depth, 16, 2, args.sweep_seq, mesh),
                       batches, args.rounds)
        for c in configs:
            r = res[c]
            last_startup.setdefault(c[0], []).append((depth, r["startup_s"]))
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


# -- replicated vs sharded state (--sweep shard) ------------------------------------------------------
SHARD_CONFIGS = [
    ("replicated + offload", {"offload": True}),
    ("sharded + offload", {"offload": True, "shard_state": True}),
    ("replicated", {}),
    ("sharded", {"shard_state": True}),
]


def shard_sweep(args) -> dict:
    """Replicated vs sharded state on the devices of this process (see the module note): one record per
    configuration with ``tokens_per_sec``, ``startup_s``, ``peak_device_bytes`` and ``host_state_bytes``
    (per device), and ``ratios``: sharded / replicated tokens/s and host bytes, with and without offload."""
    from revtrain.memory import host_state_bytes

    mesh = make_mesh()
    seq, batch = args.seq, args.batch
    builder = byte_lm.load_byte_lm(byte_lm.GENSIM_SOURCE, seq, byte_lm.default_data_dir())
    it = iter(pipeline.train_dataset(builder, batch_size=batch, seed=0))
    batches = [global_batch(next(it), mesh) for _ in range(4)]
    configs = [c for c, _ in SHARD_CONFIGS]
    kwargs = dict(SHARD_CONFIGS)

    def build(c):
        model = ReversibleTransformerLM(seq, num_layers=args.depth, d_model=args.d_model, num_heads=args.heads,
                                        dropout_rate=0.0)
        return ReversibleTrainer(model, optax.adamw(1e-4, weight_decay=0.01), mesh, seed=0, **kwargs[c])

    trainers = {}

    def keep(c):
        trainers[c] = build(c)
        return trainers[c]

    measured = _measure(configs, keep, batches, args.rounds)
    records = []
    for c in configs:
        t = trainers[c]
        ts = t.init()
        t.meter.start()  # the meter of `_measure` (its compiled-memory analyses are cached)
        ts, m = t.train_step(ts, batches[0])
        _ready(ts, m)
        peak = t.meter.stop()
        records.append({"sweep": "shard", "config": c, "devices": mesh.size, "depth": args.depth,
                        "d_model": args.d_model, "seq": seq, "batch": batch,
                        "tokens_per_sec": measured[c]["steps_per_sec"] * batch * seq,
                        "startup_s": measured[c]["startup_s"], "peak_device_bytes": peak,
                        "peak_device_bytes_method": t.meter.method, "host_state_bytes": host_state_bytes(ts)})
    by = {r["config"]: r for r in records}
    ratios = {}
    for suffix in (" + offload", ""):
        a, b = by["replicated" + suffix], by["sharded" + suffix]
        ratios["tokens_per_sec" + suffix.replace(" + ", ", ")] = b["tokens_per_sec"] / a["tokens_per_sec"]
    ratios["host_state_bytes, offload"] = (by["sharded + offload"]["host_state_bytes"]
                                           / by["replicated + offload"]["host_state_bytes"])
    ratios["peak_device_bytes"] = by["sharded"]["peak_device_bytes"] / by["replicated"]["peak_device_bytes"]
    return {"records": records, "ratios": ratios}


def shard_table(result) -> str:
    rows = ["| state | devices | tokens/s | peak device MiB | host state MiB / device | start-up s |",
            "|---|---|---|---|---|---|"]
    for r in result["records"]:
        rows.append(f"| {r['config']} | {r['devices']} | {r['tokens_per_sec']:,.0f} | "
                    f"{r['peak_device_bytes'] / 2**20:.1f} | {r['host_state_bytes'] / 2**20:.2f} | {r['startup_s']:.1f} |")
    rows.append("")
    rows += [f"sharded / replicated {k}: {v:.3f}" for k, v in result["ratios"].items()]
    return "\n".join(rows)


# -- sweep over the sequence length: blockwise vs dense attention (make bench-long) ------------------

SEQ_KINDS = ("blockwise", "dense")


def _seq_model(seq, args, kind):
    """The benchmark's LM at length ``seq``: blockwise attention + chunked feed-forward and head, or dense."""
    chunks = {"attention_block": args.attention_block, "ff_chunk": args.ff_chunk, "head_chunk": args.head_chunk}
    return ReversibleTransformerLM(seq, num_layers=args.depth, d_model=args.d_model, num_heads=args.heads,
                                   dropout_rate=0.0, **(chunks if kind == "blockwise" else {}))


class _CompileClock:
    """Seconds JAX spends tracing, lowering and compiling (its monitoring events), to leave out of a timed
    first step."""

    EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
              "/jax/core/compile/backend_compile_duration")

    def __init__(self):
        self.seconds = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kwargs):
        if event in self.EVENTS:
            self.seconds += duration


def _timed_step(trainer, ts, batch, clock):
    """One step; returns ``(state, seconds without compilation)``."""
    c0, t0 = clock.seconds, time.perf_counter()
    ts, m = trainer.train_step(ts, batch)
    _ready(ts, m)
    return ts, time.perf_counter() - t0 - (clock.seconds - c0)


def _seq_point_memory(seq, kind, args) -> tuple[int, str]:
    """Peak device bytes of one ReversibleTrainer + offload step at length ``seq`` (after a warm-up step
    below ``--one_step_from``), in this process."""
    mesh = make_mesh()
    trainer = ReversibleTrainer(_seq_model(seq, args, kind), optax.adam(1e-4), mesh, seed=0, offload=True)
    trainer.meter = MemoryMeter()
    batches = [global_batch(b, mesh) for b in _batches(args, 2, seq)]
    ts = trainer.init()
    if seq < args.one_step_from:
        ts, m = trainer.train_step(ts, batches[1])
        _ready(ts, m)
    trainer.meter.start()
    ts, m = trainer.train_step(ts, batches[0])
    _ready(ts, m)
    return trainer.meter.stop(), trainer.meter.method


def standard_estimate(seq, kind, args, mesh) -> int:
    """StandardTrainer's peak device bytes at length ``seq`` from its compiled step program, without running
    it: arguments (weights, Adam state, batch) + temporaries + outputs not aliased to donated inputs. The
    program is ``StandardTrainer.grads`` (whole-model backprop) followed by the Adam update."""
    model = _seq_model(seq, args, kind)
    trainer = StandardTrainer(model, optax.adam(1e-4), mesh, seed=0)

    def step(params, opt_state, states, batch, skey):
        _, grads, _, new_states, _ = trainer.grads(params, states, batch, skey)
        updates, opt_state = trainer.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, new_states

    spec = lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)  # noqa: E731
    params, states = jax.tree.map(spec, model.init())
    tokens = jax.ShapeDtypeStruct((args.batch, seq), jnp.int32)
    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P(), P(DATA_AXIS), P()), out_specs=(P(), P(), P())),
                 donate_argnums=(0, 1))
    compiled = fn.lower(params, jax.eval_shape(trainer.tx.init, params), states,
                        {"inputs": tokens, "targets": tokens}, jax.ShapeDtypeStruct((2,), jnp.uint32)).compile()
    a = compiled.memory_analysis()
    return int(a.argument_size_in_bytes + a.temp_size_in_bytes + max(0, a.output_size_in_bytes - a.alias_size_in_bytes))


def _seq_memory_in_subprocess(seq, kind, args) -> tuple[int, str]:
    cmd = [sys.executable, __file__, "--sweep", "seq", "--seq_memory_only", f"{seq},{kind}", *_seq_argv(args)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    peak, method = out.split()
    return int(peak), method


def _seq_argv(args) -> list[str]:
    return [f"--{name}={getattr(args, name)}" for name in
            ("depth", "d_model", "heads", "batch", "attention_block", "ff_chunk", "head_chunk", "one_step_from")]


def exactness(args, mesh) -> dict:
    """Blockwise vs dense attention in float32 at ``--exact_seq``: the training losses of 5 ReversibleTrainer
    steps from the same weights on the same batches, and whole-model backprop's gradients of every block's
    attention parameters (max |difference| / max |dense| per leaf, the worst leaf)."""
    seq, steps = args.exact_seq, 5
    batches = [global_batch(b, mesh) for b in _batches(args, steps, seq)]
    losses, grads = {}, {}
    with jax.default_matmul_precision("highest"):
        for kind in SEQ_KINDS:
            model = _seq_model(seq, args, kind)
            trainer = ReversibleTrainer(model, optax.adam(1e-4), mesh, seed=0)
            ts, out = trainer.init(), []
            for b in batches:
                ts, m = trainer.train_step(ts, b)
                out.append(float(m["loss"]))
            losses[kind] = out
            ref = StandardTrainer(model, optax.adam(1e-4), mesh, seed=0)
            fn = jax.jit(jax.shard_map(lambda p, s, b, k, ref=ref: ref.grads(p, s, b, k)[1], mesh=mesh,
                                       in_specs=(P(), P(), P(DATA_AXIS), P()), out_specs=P()))
            params, states = model.init()
            g = fn(params, states, batches[0], jax.random.PRNGKey(0))
            grads[kind] = [jax.tree.map(np.asarray, layer_grads["f"]) for layer_grads in g[1:-1]]
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses["blockwise"], losses["dense"]))
    grad_rel = max(float(np.abs(a - b).max() / np.abs(b).max())
                   for gb, gd in zip(grads["blockwise"], grads["dense"])
                   for a, b in zip(jax.tree.leaves(gb), jax.tree.leaves(gd)))
    return {"seq": seq, "steps": steps, "losses": losses, "loss_max_rel_diff": loss_rel,
            "attention_grad_max_rel_diff": grad_rel}


def run_seq(args) -> dict:
    mesh = make_mesh()
    device = jax.devices()[0]
    on_cpu = device.platform == "cpu"
    clock = _CompileClock()
    records = []
    for seq in args.seqs:
        kinds = [k for k in SEQ_KINDS if k == "blockwise" or seq <= args.dense_max]
        one_step = seq >= args.one_step_from
        batches = [global_batch(b, mesh) for b in _batches(args, 1 if one_step else 2 + args.steps, seq)]
        times = collections.defaultdict(list)
        peaks = {}
        trainers, states = {}, {}
        for kind in kinds:
            trainer = ReversibleTrainer(_seq_model(seq, args, kind), optax.adam(1e-4), mesh, seed=0, offload=True)
            ts = trainer.init()
            if one_step:  # one step: metered (on CPU) and timed without its compilation
                trainer.meter = MemoryMeter() if on_cpu else None
                if trainer.meter:
                    trainer.meter.start()
                ts, dt = _timed_step(trainer, ts, batches[0], clock)
                times[kind].append(dt)
                if trainer.meter:
                    peaks[kind] = (trainer.meter.stop(), trainer.meter.method)
                del trainer, ts
            else:
                ts, _ = _timed_step(trainer, ts, batches[0], clock)  # compiles
                if on_cpu:
                    trainer.meter = MemoryMeter()
                    trainer.meter.start()
                    ts, _ = _timed_step(trainer, ts, batches[1], clock)
                    peaks[kind] = (trainer.meter.stop(), trainer.meter.method)
                    trainer.meter = None
                trainers[kind], states[kind] = trainer, ts
        for batch in batches[2:] if not one_step else []:  # interleaved rounds
            for kind in kinds:
                states[kind], dt = _timed_step(trainers[kind], states[kind], batch, clock)
                times[kind].append(dt)
        del trainers, states
        for kind in kinds:
            peak, method = peaks[kind] if kind in peaks else _seq_memory_in_subprocess(seq, kind, args)
            tps = args.batch * seq / statistics.median(times[kind])
            rec = {"seq": seq, "attention": kind, "trainer": "reversible", "offload": True,
                   "peak_device_bytes": peak, "memory_method": method, "tokens_per_sec": tps,
                   "timed_steps": len(times[kind])}
            records.append(rec)
            print(f"T {seq:>6} {kind:>9} reversible + offload  peak {peak / 2**20:9.1f} MiB  {tps:9,.0f} tok/s "
                  f"({len(times[kind])} timed step{'s' if len(times[kind]) > 1 else ''})", flush=True)
        for kind in SEQ_KINDS:
            try:
                peak = standard_estimate(seq, kind, args, mesh)
            except jax.errors.JaxRuntimeError as e:  # an accelerator's compiler can refuse what cannot fit
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                print(f"T {seq:>6} {kind:>9} standard (compiled)   does not compile: out of memory", flush=True)
                continue
            records.append({"seq": seq, "attention": kind, "trainer": "standard", "offload": False,
                            "peak_device_bytes": peak, "memory_method": "compiled", "tokens_per_sec": None,
                            "timed_steps": 0})
            print(f"T {seq:>6} {kind:>9} standard (compiled)   peak {peak / 2**20:9.1f} MiB", flush=True)
        tps = {r["attention"]: r["tokens_per_sec"] for r in records if r["seq"] == seq and r["trainer"] == "reversible"}
        if "dense" in tps:
            print(f"T {seq:>6} blockwise / dense tokens/s: {tps['blockwise'] / tps['dense']:.2f}", flush=True)
    config = {"platform": device.platform, "device_kind": device.device_kind, "d_model": args.d_model,
              "heads": args.heads, "depth": args.depth, "batch": args.batch, "attention_block": args.attention_block,
              "ff_chunk": args.ff_chunk, "head_chunk": args.head_chunk, "steps": args.steps,
              "one_step_from": args.one_step_from}
    result = {"config": config, "records": records}
    if args.exact_seq:
        result["exactness"] = exactness(args, mesh)
        e = result["exactness"]
        print(f"T {e['seq']} float32, blockwise vs dense: losses over {e['steps']} steps within "
              f"{e['loss_max_rel_diff']:.1e} relative, attention gradients within "
              f"{e['attention_grad_max_rel_diff']:.1e}", flush=True)
    return result


def table_seq(result) -> str:
    records = result["records"]
    lines = ["| T | trainer | attention | peak device MiB | tokens/s | blockwise / dense tokens/s |",
             "|---|---|---|---|---|---|"]
    for r in records:
        name = "reversible + offload" if r["trainer"] == "reversible" else "standard (compiled estimate)"
        tps = "" if r["tokens_per_sec"] is None else f"{r['tokens_per_sec']:,.0f}"
        if r["timed_steps"] == 1:
            tps += " (1 step)"
        ratio = ""
        if r["trainer"] == "reversible" and r["attention"] == "blockwise":
            dense = [d for d in records if d["seq"] == r["seq"] and d["trainer"] == "reversible"
                     and d["attention"] == "dense"]
            ratio = f"{r['tokens_per_sec'] / dense[0]['tokens_per_sec']:.2f}" if dense else ""
        peak = r["peak_device_bytes"] / 2**20
        lines.append(f"| {r['seq']} | {name} | {r['attention']} | {peak:,.1f} | {tps} | {ratio} |")
    return "\n".join(lines)


def plot_seq(result, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    records, c = result["records"], result["config"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for trainer, kind, style in (("reversible", "blockwise", "o-"), ("reversible", "dense", "s-"),
                                 ("standard", "blockwise", "o:"), ("standard", "dense", "s:")):
        rs = [r for r in records if r["trainer"] == trainer and r["attention"] == kind]
        label = f"{trainer}{' + offload' if trainer == 'reversible' else ' (compiled estimate)'}, {kind}"
        a.plot([r["seq"] for r in rs], [r["peak_device_bytes"] / 2**20 for r in rs], style, label=label)
        if trainer == "reversible":
            b.plot([r["seq"] for r in rs], [r["tokens_per_sec"] for r in rs], style, label=label)
    method = next(r["memory_method"] for r in records if r["trainer"] == "reversible")
    fig.suptitle(f"{c['device_kind']} ({method}), d_model {c['d_model']}, {c['heads']} heads, depth {c['depth']}, "
                 f"batch {c['batch']}, attention block {c['attention_block']}")
    for ax, ylabel in ((a, "peak device memory (MiB)"), (b, "tokens / s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", choices=("trainers", "depth", "seq", "shard", "point"), default="trainers",
                   help="trainers: the three trainers' memory and speed against depth (make bench); depth: "
                        "tiny blocks at depths 8..256 (make bench-depth); seq: attention against length "
                        "(make bench-long); shard: replicated vs sharded state on --shard_devices devices")
    p.add_argument("--depths", default="2,4,8,16,32", type=lambda s: [int(x) for x in s.split(",") if x])
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=None, help="default 8 (depth), 1 (seq)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=None, help="default bench.json (depth), bench_long.json (seq)")
    p.add_argument("--plot", default=None, help="default bench.png (depth), bench_long.png (seq)")
    p.add_argument("--memory_only", help=argparse.SUPPRESS)
    p.add_argument("--bench_attention_block", type=lambda s: int(s) or None, default=None,
                   help="--sweep point: blockwise attention in tiles of this many positions (with the chunked "
                        "feed-forward and head, --ff_chunk / --head_chunk); 0: dense")
    p.add_argument("--configs", default=None, type=lambda s: [x.strip() for x in s.split(";") if x.strip()],
                   help="make bench: only these trainers, ';'-separated labels of CONFIGS (e.g. 'remat;reversible fused')")
    p.add_argument("--long_depth", type=int, default=32, help="make bench: depth of the activation-dominated point")
    p.add_argument("--long_seq", type=int, default=4096,
                   help="make bench: T of the activation-dominated point (0: skip it)")
    p.add_argument("--long_attention_block", type=int, default=512)
    p.add_argument("--long_batch", type=int, default=1,
                   help="make bench: batch of the activation-dominated point (1 x 4,096: the depth points' tokens)")
    p.add_argument("--long_steps", type=int, default=1, help="timed steps of the activation-dominated point")
    p.add_argument("--compute_dtype", default=None, help="the model's compute dtype (default: the model's)")
    p.add_argument("--point", default=None, help="--sweep point: the CONFIGS label to run (one JSON line out)")
    # --sweep depth
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per configuration (--sweep depth)")
    p.add_argument("--max_startup", type=float, default=600.0,
                   help="skip a sweep configuration once its start-up time would pass this many seconds")
    p.add_argument("--only", default=None, type=lambda s: [x.strip() for x in s.split(";") if x.strip()],
                   help="--sweep depth: only these configurations, ';'-separated labels (e.g. 'reversible, scan')")
    p.add_argument("--sweep_seq", type=int, default=32)
    p.add_argument("--sweep_batch", type=int, default=4)
    p.add_argument("--offload_widths", default="64,128,256", type=lambda s: [int(x) for x in s.split(",") if x],
                   help="d_model values of the offload comparison (empty: skip it)")
    p.add_argument("--offload_depth", type=int, default=8)
    # --sweep seq
    p.add_argument("--seqs", default="512,1024,4096,16384,65536", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--depth", type=int, default=4, help="reversible blocks (--sweep seq)")
    p.add_argument("--attention_block", type=int, default=512)
    p.add_argument("--ff_chunk", type=int, default=1024)
    p.add_argument("--head_chunk", type=int, default=1024)
    p.add_argument("--dense_max", type=int, default=4096, help="longest T run with dense attention")
    p.add_argument("--one_step_from", type=int, default=16384, help="from this T on: one metered, timed step")
    p.add_argument("--exact_seq", type=int, default=512, help="T of the blockwise-vs-dense check (0: skip)")
    p.add_argument("--seq_memory_only", help=argparse.SUPPRESS)
    # --sweep shard
    p.add_argument("--shard_devices", type=int, default=4, help="forced CPU devices (--sweep shard)")
    args = p.parse_args()
    if args.sweep == "shard":
        flag = f"--xla_force_host_platform_device_count={args.shard_devices}"
        if flag not in os.environ.get("XLA_FLAGS", ""):  # JAX reads it when its backend starts: run again
            env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip())
            sys.exit(subprocess.run([sys.executable, *sys.argv], env=env).returncode)
        if "--seq" not in sys.argv:
            args.seq = 128
        if "--d_model" not in sys.argv:
            args.d_model = 128
        if "--depth" not in sys.argv:
            args.depth = 6
        args.batch = args.batch or 32
        out = args.out or "bench_shard.json"
        result = shard_sweep(args)
        pathlib.Path(out).write_text(json.dumps(result, indent=1) + "\n")
        print(shard_table(result))
        print(f"wrote {os.path.abspath(out)}")
        return
    if args.sweep == "depth":
        if "--depths" not in sys.argv:
            args.depths = [8, 32, 64, 128, 256]
        out, png = args.out or "bench_depth.json", args.plot or "bench_depth.png"
        result = depth_sweep(args)
        pathlib.Path(out).write_text(json.dumps(result, indent=1) + "\n")
        depth_plot(result, png)
        print(depth_table(result))
        print(f"wrote {os.path.abspath(out)} and {os.path.abspath(png)}")
        return
    if args.sweep == "point":
        args.batch = args.batch or 8
        args.ff_chunk = args.ff_chunk if args.bench_attention_block else None
        args.head_chunk = args.head_chunk if args.bench_attention_block else None
        print(json.dumps(point(args)), flush=True)
        return
    seq = args.sweep == "seq"
    args.batch = args.batch or (1 if seq else 8)
    args.out = args.out or ("bench_long.json" if seq else "bench.json")
    args.plot = args.plot or ("bench_long.png" if seq else "bench.png")
    if seq and args.seq_memory_only:
        length, kind = args.seq_memory_only.split(",")
        print(*_seq_point_memory(int(length), kind, args))
        return
    if args.memory_only:
        label, depth, length = args.memory_only.rsplit(",", 2)
        peak, method = measure_memory(label, int(depth), args, int(length))
        print(peak, method)
        return
    records = run_seq(args) if seq else run(args)
    pathlib.Path(args.out).write_text(json.dumps(records, indent=1) + "\n")
    (plot_seq if seq else plot)(records, args.plot)
    print((table_seq if seq else table)(records))
    print(f"wrote {os.path.abspath(args.out)} and {os.path.abspath(args.plot)}")


if __name__ == "__main__":
    main()
