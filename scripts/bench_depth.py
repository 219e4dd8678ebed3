"""Steps/s and start-up time of tiny blocks against depth (``make bench-depth``), for both executors (per
layer or scanned) of both trainers, the cost of a logged step (memory meter on), and offload against no
offload at a few widths.

  python scripts/bench_depth.py [--depths 8,32,64,128,256] [--rounds 5] [--max_startup 600]
                                [--only 'reversible, scan;standard, scan'] [--sweep_seq 32] [--sweep_batch 4]
                                [--offload_widths 64,128,256] [--offload_depth 8]
                                [--out bench_depth.json] [--plot bench_depth.png]

How: the model is tiny (d_model 16, 2 heads, dropout 0.1, Adam) on ``--sweep_batch`` x ``--sweep_seq`` real
bytes (the English-Wikipedia excerpt). At each depth every configuration of ``DEPTH_CONFIGS`` is built and
stepped once (start-up: tracing, compilation, first run, in seconds), then timed in ``--rounds`` interleaved
rounds (one step of each configuration per round; the median step time), unlogged and with the memory
meter on (``logged_over_unlogged``). A configuration whose start-up, extrapolated to the next depth, would
pass ``--max_startup`` seconds is skipped from there on (recorded with the reason). Then offload against no
offload (``OFFLOAD_CONFIGS``) at d_model ``--offload_widths``, depth ``--offload_depth``. All in this process.

Outputs: ``--out`` (default bench_depth.json: ``depth`` and ``offload`` records, ``skipped``, the platform),
``--plot`` (default bench_depth.png: steps/s and start-up against depth) and markdown tables on stdout.
"""

from __future__ import annotations

import argparse
import math

import bench_common as common  # first: puts the repository on sys.path when revtrain is not installed

import jax  # noqa: E402

from revtrain.data import byte_lm, pipeline  # noqa: E402
from revtrain.models import ReversibleTransformerLM  # noqa: E402
from revtrain.placement import global_batch, make_mesh  # noqa: E402

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
    return common.make_trainer(kind, model, mesh, **kwargs)


def _sweep_batches(seq, batch, n):
    """``n`` real batches of ``seq`` bytes (the first ``seq`` bytes of the prepared 128-byte examples)."""
    builder = byte_lm.load_byte_lm(byte_lm.GENSIM_SOURCE, 128, byte_lm.default_data_dir())
    it = iter(pipeline.train_dataset(builder, batch_size=batch, seed=0))
    return [{k: v[:, :seq] for k, v in next(it).items()} for _ in range(n)]


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
    Records carry ``startup_s`` and ``step_s`` (seconds), ``steps_per_sec`` and ``logged_over_unlogged``.
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
        res = common.measure(configs, lambda c: _depth_trainer(c[1], dict(c[2]), depth, 16, 2, args.sweep_seq, mesh),
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
        res = common.measure(configs, lambda c: _depth_trainer(c[1], dict(c[2]), args.offload_depth, width, heads,
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
    """Steps/s and start-up seconds against depth, log-log, a line per configuration; PNG at ``path``."""
    plt = common.pyplot()
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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--depths", default="8,32,64,128,256", type=lambda s: [int(x) for x in s.split(",") if x])
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per configuration")
    p.add_argument("--max_startup", type=float, default=600.0,
                   help="skip a configuration once its start-up time would pass this many seconds")
    p.add_argument("--only", default=None, type=lambda s: [x.strip() for x in s.split(";") if x.strip()],
                   help="only these configurations, ';'-separated labels (e.g. 'reversible, scan')")
    p.add_argument("--sweep_seq", type=int, default=32, help="sequence length (at most 128)")
    p.add_argument("--sweep_batch", type=int, default=4)
    p.add_argument("--offload_widths", default="64,128,256", type=lambda s: [int(x) for x in s.split(",") if x],
                   help="d_model values of the offload comparison (empty: skip it)")
    p.add_argument("--offload_depth", type=int, default=8)
    p.add_argument("--out", default="bench_depth.json")
    p.add_argument("--plot", default="bench_depth.png")
    args = p.parse_args()
    common.write_outputs(depth_sweep(args), args.out, depth_table, depth_plot, args.plot)


if __name__ == "__main__":
    main()
