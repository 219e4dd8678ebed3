"""Memory and speed of StandardTrainer (plain, remat, remat + offload) against ReversibleTrainer (exact, fused
and fenced rebuild, with and without offload) against depth (``make bench``), or one configuration in its
own process (``--point``, for scripts/gpu_report.sh).

  python scripts/bench_trainers.py [--depths 2,4,8,16,32] [--d_model 256] [--seq 512] [--batch 8]
                                   [--steps 3] [--configs 'remat;reversible fused'] [--long_depth 32]
                                   [--long_seq 4096] [--long_batch 1] [--long_steps 1]
                                   [--out bench.json] [--plot bench.png]
  python scripts/bench_trainers.py --point 'reversible fused + offload' --depth 4 [--d_model ...]
                                   [--compute_dtype bfloat16] [--bench_attention_block 1024]

How: for each depth of ``--depths`` the trainers of ``CONFIGS`` (or ``--configs``) are built on the same
model and the same real batches (the English-Wikipedia excerpt), warmed up (``--warmup`` steps:
compilation), then timed in ``--steps`` interleaved rounds (one step of each trainer per round, so machine
noise hits all alike); tokens/s is the median over rounds. After the depths, an activation-dominated point
(``--long_depth`` blocks at ``--long_seq`` positions, batch ``--long_batch``, blockwise attention in tiles of
``--long_attention_block`` with the chunked feed-forward and head). Peak device bytes of one step after a
warm-up step come from the memory meter (``revtrain.memory``): the allocator's peak on GPU/TPU, measured in a
fresh subprocess per configuration (that peak cannot be reset), the live-array + compiled-temp estimate on
the CPU, measured in this process.

Outputs: ``--out`` (default bench.json: one record per trainer x point, with ``tokens_per_sec``,
``peak_device_bytes`` and the ratios to standard, remat and reversible exact), ``--plot`` (default bench.png:
peak MiB and tokens/s against depth, log scales) and two markdown tables on stdout (a row per record;
README's, a row per trainer). ``--table_from bench.json`` prints the tables of an earlier run again.

``--point LABEL``: one configuration of ``CONFIGS`` in this process at ``--depth`` blocks: ``--warmup``
steps, ``--steps`` timed steps (median), the memory meter on the last; prints one JSON record (a step that
runs out of device memory gives ``status: "out of memory"``). scripts/gpu_report.sh (``make bench-gpu``)
runs one process per configuration this way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import bench_common as common  # first: puts the repository on sys.path when revtrain is not installed

import jax  # noqa: E402

from revtrain.memory import MemoryMeter  # noqa: E402
from revtrain.models import ReversibleTransformerLM  # noqa: E402
from revtrain.placement import make_mesh  # noqa: E402

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
    # Offload runs the streaming engine (revtrain/streaming.py): per-layer programs, the state in pageable host
    # memory, each layer fetched ahead and written back behind; against the per-layer trainer in device memory.
    ("reversible exact + offload", "reversible", {"rebuild": "exact", "offload": True}),
    ("reversible fused + offload", "reversible", {"rebuild": "fused", "offload": True}),
    ("reversible exact per layer", "reversible", {"rebuild": "exact", "scan_layers": False}),
    ("reversible fused per layer", "reversible", {"rebuild": "fused", "scan_layers": False}),
    ("reversible fused, top fused", "reversible", {"rebuild": "fused", "fuse_top": True}),
]
_BY_LABEL = {label: (kind, kwargs) for label, kind, kwargs in CONFIGS}


def _trainer(label, depth, args, mesh, seq=None):
    """The trainer ``label`` of ``CONFIGS`` on the benchmark's LM (``seq`` positions, default ``--seq``;
    ``--bench_attention_block`` for blockwise attention, then also ``--ff_chunk`` and ``--head_chunk``)."""
    kind, kwargs = _BY_LABEL[label]
    extra = {name: getattr(args, name) for name in ("compute_dtype", "ff_chunk", "head_chunk")
             if getattr(args, name, None) is not None and (name == "compute_dtype" or args.bench_attention_block)}
    model = ReversibleTransformerLM(seq or args.seq, num_layers=depth, d_model=args.d_model, num_heads=args.heads,
                                    dropout_rate=0.0, attention_block=getattr(args, "bench_attention_block", None),
                                    **extra)
    return common.make_trainer(kind, model, mesh, **kwargs)


def measure_memory(label, depth, args, seq=None) -> tuple[int, str]:
    """Peak device bytes of one step of trainer ``label`` after a warm-up step, in this process. Returns
    ``(bytes, memory meter method)``."""
    mesh = make_mesh()
    trainer = _trainer(label, depth, args, mesh, seq)
    meter = MemoryMeter()
    trainer.meter = meter
    ts = trainer.init()
    batches = common.batches(seq or args.seq, args.batch, 2, mesh)
    ts, m = trainer.train_step(ts, batches[0])
    jax.block_until_ready(m)
    meter.start()
    ts, m = trainer.train_step(ts, batches[1])
    common.ready(ts, m)
    return meter.stop(), meter.method


def _memory_in_subprocess(label, depth, args, seq=None) -> tuple[int, str]:
    """``measure_memory`` in a fresh process (this script with ``--memory_only``), on the same model: every
    option ``_trainer`` reads is passed on."""
    dtype = ["--compute_dtype", args.compute_dtype] if args.compute_dtype is not None else []
    return common.peak_in_subprocess(__file__, [
        "--memory_only", f"{label},{depth},{seq or args.seq}", "--d_model", str(args.d_model), "--batch",
        str(args.batch), "--heads", str(args.heads), "--bench_attention_block", str(args.bench_attention_block or 0),
        "--ff_chunk", str(args.ff_chunk), "--head_chunk", str(args.head_chunk), *dtype])


def _point(args, mesh, depth, seq, warmup, steps, labels) -> list[dict]:
    """One benchmark point: every trainer of ``labels`` on the same model and batches, warmed up, then timed
    in interleaved rounds (median), then metered."""
    on_cpu = jax.devices()[0].platform == "cpu"
    batches = common.batches(seq, args.batch, warmup + steps, mesh)
    tokens = args.batch * seq
    trainers, states = {}, {}
    for label in labels:
        t = _trainer(label, depth, args, mesh, seq)
        ts = t.init()
        for b in batches[:warmup]:
            ts, m = t.train_step(ts, b)
        common.ready(ts, m)
        trainers[label], states[label] = t, ts
    times = common.timed_rounds(labels, trainers, states, batches[warmup:], steps)
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
    """One configuration in this process (``--point``, for ``scripts/gpu_report.sh``): trainer ``--point`` at
    depth ``--depth``, ``--warmup`` steps, ``--steps`` timed steps, the memory meter on the last. Returns one
    record (``tokens_per_sec``, ``peak_device_bytes``, ``warmup_s`` in seconds, ``state_bytes``: weights +
    Adam's two moments in float32; ``step_s``, the median timed step in seconds; with offload ``moved_h2d_bytes``
    and ``moved_d2h_bytes``, what the host tier moves each step); a step that runs out of device memory gives
    ``status: "out of memory"``."""
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
        rec["state_bytes"] = 3 * sum(x.size * x.dtype.itemsize for layer in trainer.model.layers
                                     for x in jax.tree.leaves(layer.param_shapes))
        ts = trainer.init()
        batches = common.batches(args.seq, args.batch, args.warmup + args.steps, mesh)
        t0 = time.perf_counter()
        for b in batches[: args.warmup]:
            ts, m = trainer.train_step(ts, b)
        common.ready(ts, m)
        rec["warmup_s"] = time.perf_counter() - t0
        trainer.meter = MemoryMeter()
        times = []
        for i, b in enumerate(batches[args.warmup:]):
            last = i == args.steps - 1
            if last:
                trainer.meter.start()
            t0 = time.perf_counter()
            ts, m = trainer.train_step(ts, b)
            common.ready(ts, m)
            times.append(time.perf_counter() - t0)
            if last:
                rec["peak_device_bytes"], rec["memory_method"] = trainer.meter.stop(), trainer.meter.method
        rec.update(status="ok", loss=float(m["loss"]), timed_steps=len(times), step_s=statistics.median(times),
                   tokens_per_sec=args.batch * args.seq / statistics.median(times))
        if rec["offload"]:
            # What the host tier moves a step (the update on the device): every layer's float32 weights in for
            # the forward; weights and Adam's two moments in for the backward and out after the update.
            rec["moved_h2d_bytes"], rec["moved_d2h_bytes"] = 4 * rec["state_bytes"] // 3, rec["state_bytes"]
    except Exception as e:  # noqa: BLE001 (the record says what happened; out of memory is a result here)
        text = f"{type(e).__name__}: {e}"
        oom = "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
        rec.update(status="out of memory" if oom else "error", error=text.splitlines()[0][:300])
    return rec


def run(args) -> list[dict]:
    """The depth points (``--depths`` at ``--seq``; none for an empty ``--depths``), then the
    activation-dominated point (``--long_depth`` blocks at ``--long_seq`` positions, batch ``--long_batch``,
    blockwise attention, ``--long_steps`` timed steps; skipped when ``--long_seq`` is 0). One record per
    trainer x point (``tokens_per_sec``, ``peak_device_bytes`` in bytes)."""
    mesh = make_mesh()
    labels = [label for label, _, _ in CONFIGS if not args.configs or label in args.configs]
    records = []

    def keep():  # the points so far in --out (a run cut short keeps its finished points)
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)

    for depth in args.depths:
        records += _point(args, mesh, depth, args.seq, args.warmup, args.steps, labels)
        keep()
    if args.long_seq:
        batch, args.batch, args.bench_attention_block = args.batch, args.long_batch, args.long_attention_block
        records += _point(args, mesh, args.long_depth, args.long_seq, 1, args.long_steps, labels)
        args.batch, args.bench_attention_block = batch, None
    return records


def table(records) -> str:
    """The markdown table of ``run``'s records: peak device MiB, tokens/s and the ratios, a row per record."""
    lines = ["| depth | T | trainer | peak device MiB | tokens/s | vs standard | vs remat | vs reversible exact |",
             "|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
    for r in records:
        lines.append(f"| {r['depth']} | {r['seq']} | {r['config']} | {r['peak_device_bytes'] / 2**20:.1f} | "
                     f"{r['tokens_per_sec']:,.0f} | {fmt(r['ratio_to_standard'])} | {fmt(r['ratio_to_remat'])} | "
                     f"{fmt(r['ratio_to_exact'])} |")
    return "\n".join(lines)


def summary(records) -> str:
    """README's table of ``run``'s records: a row per trainer; for each point (depth x T) its peak device
    MiB, tokens/s and tokens/s against remat's at that point."""
    points = list(dict.fromkeys((r["depth"], r["seq"]) for r in records))
    by = {(r["config"], r["depth"], r["seq"]): r for r in records}
    head = ["trainer"] + [f"depth {d}, T {t}: peak MiB, tokens/s (vs remat)" for d, t in points]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in dict.fromkeys(r["config"] for r in records):
        cells = [label]
        for d, t in points:
            r = by.get((label, d, t))
            ratio = "" if r is None or r["ratio_to_remat"] is None else f" ({r['ratio_to_remat']:.2f}x)"
            cells.append("" if r is None else f"{r['peak_device_bytes'] / 2**20:,.0f}, {r['tokens_per_sec']:,.0f}{ratio}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tables(records) -> str:
    """Both tables: `table` (a row per record) and `summary` (README's)."""
    return table(records) + "\n\n" + summary(records)


def plot(records, path) -> None:
    """Peak device MiB and tokens/s against depth (the depth points at the first record's T), PNG at ``path``."""
    plt = common.pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    r0 = records[0]
    for label, _, _ in CONFIGS:
        rs = [r for r in records if r["config"] == label and r["seq"] == r0["seq"]]
        if not rs:
            continue
        style = "s--" if "offload" in label else "o-"  # on the CPU remat + offload lies on remat: dashed over solid
        a.plot([r["depth"] for r in rs], [r["peak_device_bytes"] / 2**20 for r in rs], style, label=label)
        b.plot([r["depth"] for r in rs], [r["tokens_per_sec"] for r in rs], style, label=label)
    title = f"{r0['device_kind']} ({r0['memory_method']}), d_model {r0['d_model']}, seq {r0['seq']}, batch {r0['batch']}"
    for ax, ylabel in ((a, "peak device memory (MiB, log scale)"), (b, "tokens / s (log scale)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["depth"] for r in records if r["seq"] == r0["seq"]}))
        ax.get_xaxis().set_major_formatter("{x:.0f}")
        ax.set_xlabel("depth (blocks)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3, which="both")
    from matplotlib import ticker
    for ax in (a, b):  # both on log scales (memory spans 30x, speed 20x), ticks at 1, 2, 5 x 10^k
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter("{x:,.0f}")
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    b.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--depths", default="2,4,8,16,32", type=lambda s: [int(x) for x in s.split(",") if x],
                   help="depths of the depth points, ','-separated (empty: none)")
    p.add_argument("--d_model", type=int, default=256, help="model width")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--seq", type=int, default=512, help="T of the depth points (and of --point)")
    p.add_argument("--batch", type=int, default=8, help="global batch of the depth points")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps (compilation) before the timed ones")
    p.add_argument("--steps", type=int, default=3, help="timed steps (interleaved rounds) per point")
    p.add_argument("--out", default="bench.json", help="JSON of the records (written after each point, so a run cut short keeps its finished points)")
    p.add_argument("--plot", default="bench.png", help="PNG of peak memory and tokens/s against depth")
    p.add_argument("--memory_only", help=argparse.SUPPRESS)
    p.add_argument("--table_from", default=None, help="print the tables of an earlier run's JSON (no run)")
    p.add_argument("--bench_attention_block", type=lambda s: int(s) or None, default=None,
                   help="blockwise attention in tiles of this many positions (with the chunked feed-forward "
                        "and head, --ff_chunk / --head_chunk); 0: dense")
    p.add_argument("--ff_chunk", type=int, default=1024, help="with blockwise attention: feed-forward chunk")
    p.add_argument("--head_chunk", type=int, default=1024, help="with blockwise attention: head loss chunk")
    p.add_argument("--configs", default=None, type=lambda s: [x.strip() for x in s.split(";") if x.strip()],
                   help="only these trainers, ';'-separated labels of CONFIGS (e.g. 'remat;reversible fused')")
    p.add_argument("--long_depth", type=int, default=32, help="depth of the activation-dominated point")
    p.add_argument("--long_seq", type=int, default=4096, help="T of the activation-dominated point (0: skip it)")
    p.add_argument("--long_attention_block", type=int, default=512, help="attention tile of the activation-dominated point")
    p.add_argument("--long_batch", type=int, default=1,
                   help="batch of the activation-dominated point (1 x 4,096: the depth points' tokens)")
    p.add_argument("--long_steps", type=int, default=1, help="timed steps of the activation-dominated point")
    p.add_argument("--compute_dtype", default=None, help="the model's compute dtype (default: the model's)")
    p.add_argument("--point", default=None,
                   help="one configuration in this process: the CONFIGS label to run (one JSON line out)")
    p.add_argument("--depth", type=int, default=4, help="--point: reversible blocks")
    args = p.parse_args()
    if args.memory_only:
        label, depth, length = args.memory_only.rsplit(",", 2)
        peak, method = measure_memory(label, int(depth), args, int(length))
        print(peak, method)
        return
    if args.point:
        print(json.dumps(point(args)), flush=True)
        return
    if args.table_from:
        with open(args.table_from) as f:
            print(tables(json.load(f)))
        return
    common.write_outputs(run(args), args.out, tables, plot, args.plot)


if __name__ == "__main__":
    main()
