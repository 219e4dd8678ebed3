"""Tokens/s against the device-memory budget (``make bench-budget``): StandardTrainer (plain, remat, remat +
offload), ReversibleTrainer (exact and fused rebuild) and the budgeted ReversibleTrainer
(``memory_budget``, exact and fused rebuild for its rebuilt blocks) at each budget (issue 38).

  python scripts/bench_budget.py [--depths 8,32] [--d_model 256] [--seq 512] [--batch 8] [--rounds 3]
                                 [--budgets 6] [--out bench_budget.json] [--plot bench_budget.png]

How: per depth, every fixed trainer and then the budgeted trainer at ``--budgets`` budgets spread from the
reversible exact trainer's measured peak to the standard trainer's (plus each fixed trainer's own peak) are
built on the same model and real batches, warmed up (2 steps), timed in ``--rounds`` interleaved rounds (one
step of each per round; median), then each one's peak device bytes of one step after a warm-up step is
measured by the memory meter in this process (the CPU estimate: live arrays + each call's compiled
temporaries; one trainer alive at a time). For each budget the table gives the budgeted trainer's tokens/s,
its measured peak, its plan (blocks backprop / checkpoint / remat / rebuild) and its ratio to the fastest fixed trainer
whose measured peak is within that budget (the issue's target: >= 0.98x, and a peak within the budget).
Outputs: ``--out`` (JSON records), ``--plot`` (tokens/s against budget, one line per trainer: a fixed trainer
is a step at its own peak) and a markdown table on stdout.

``--point 'budgeted fused' --budget 4GiB --depth 16``: one budgeted trainer in this process (2 warm-up steps,
``--rounds`` timed steps, the meter on the last: the allocator's peak on a GPU); prints one JSON record with
its plan. scripts/gpu_report.sh runs the budget curve this way, one process per budget.

A budget is a bound: either form exits with status 1, naming them, when a budgeted trainer's measured
peak is over its budget (the records are written first).
"""

from __future__ import annotations

import argparse
import gc
import statistics

import bench_common as common  # first: puts the repository on sys.path when revtrain is not installed

import jax  # noqa: E402
import numpy as np  # noqa: E402

from revtrain.memory import MemoryMeter  # noqa: E402
from revtrain.models import ReversibleTransformerLM  # noqa: E402
from revtrain.placement import make_mesh  # noqa: E402

FIXED = [
    ("standard", "standard", {}),
    ("remat", "standard", {"scan_layers": True, "remat_layers": True}),
    ("remat + offload", "standard", {"scan_layers": True, "remat_layers": True, "remat_offload": True}),
    ("reversible exact", "reversible", {"rebuild": "exact"}),
    ("reversible fused", "reversible", {"rebuild": "fused"}),
]
BUDGETED = [("budgeted exact", {"rebuild": "exact"}), ("budgeted fused", {"rebuild": "fused"})]


def _model(depth, args):
    return ReversibleTransformerLM(args.seq, num_layers=depth, d_model=args.d_model, num_heads=args.heads,
                                   dropout_rate=0.0)


def _peak(trainer, batches) -> int:
    """Peak device bytes of one step after a warm-up step (the memory meter), this trainer alone alive."""
    ts = trainer.init()
    ts, m = trainer.train_step(ts, batches[0])
    common.ready(ts, m)
    trainer.meter = meter = MemoryMeter()
    meter.start()
    ts, m = trainer.train_step(ts, batches[1])
    common.ready(ts, m)
    return meter.stop()


def _time(builds: dict, batches, rounds: int) -> dict:
    """Tokens/s (median of interleaved rounds) of every trainer of ``builds`` (label -> constructor)."""
    trainers, states = {}, {}
    for label, build in builds.items():
        t = build()
        ts = t.init()
        for b in batches[:2]:
            ts, m = t.train_step(ts, b)
        common.ready(ts, m)
        trainers[label], states[label] = t, ts
    times = common.timed_rounds(list(builds), trainers, states, batches[2:], rounds)
    return {label: statistics.median(v) for label, v in times.items()}, trainers


def run_depth(depth: int, args, mesh) -> list[dict]:
    batches = common.batches(args.seq, args.batch, 2 + args.rounds, mesh)
    tokens = args.batch * args.seq
    model = _model(depth, args)
    fixed_peak = {}
    for label, kind, kw in FIXED:
        fixed_peak[label] = _peak(common.make_trainer(kind, model, mesh, **kw), batches)
        gc.collect()
        print(f"depth {depth} {label}: peak {fixed_peak[label] / 2**20:.0f} MiB", flush=True)
    lo, hi = fixed_peak["reversible exact"], fixed_peak["standard"]
    budgets = sorted({int(b) for b in np.linspace(lo, hi, args.budgets)} | {p for p in fixed_peak.values() if p >= lo})
    builds = {label: (lambda kind=kind, kw=kw: common.make_trainer(kind, model, mesh, **kw)) for label, kind, kw in FIXED}
    analyses = {name: {} for name, _ in BUDGETED}  # one plan analysis (compiled, timed) per budgeted trainer kind

    def budgeted(name, kw, b):
        t = common.make_trainer("reversible", model, mesh, memory_budget=b, **kw)
        t._budget_candidates = analyses[name]  # the same model and settings but the budget: the same table
        return t

    for name, kw in BUDGETED:
        for b in budgets:
            builds[f"{name} @ {b}"] = lambda b=b, kw=kw, name=name: budgeted(name, kw, b)
    step_s, trainers = _time(builds, batches, args.rounds)
    plans = {label: t.budget_plan for label, t in trainers.items() if getattr(t, "budget_plan", None) is not None}
    del trainers
    gc.collect()
    records = []
    for label, kind, kw in FIXED:
        records.append({"depth": depth, "config": label, "budget": None, "peak_device_bytes": fixed_peak[label],
                        "tokens_per_sec": tokens / step_s[label]})
    for name, kw in BUDGETED:
        for b in budgets:
            label = f"{name} @ {b}"
            peak = _peak(budgeted(name, kw, b), batches)
            gc.collect()
            fits = [r for r in records[:len(FIXED)] if r["peak_device_bytes"] <= b]
            best = max(fits, key=lambda r: r["tokens_per_sec"]) if fits else None
            plan = plans[label]
            tps = tokens / step_s[label]
            rec = {"depth": depth, "config": name, "budget": b, "peak_device_bytes": peak, "tokens_per_sec": tps,
                   "plan": plan.counts(), "plan_peak_bytes": plan.peak, "within_budget": peak <= b,
                   "fastest_fixed_within": best["config"] if best else None,
                   "ratio_to_fastest_within": tps / best["tokens_per_sec"] if best else None}
            records.append(rec)
            print(f"depth {depth} {label}: {plan.line()}; measured {peak / 2**20:.0f} MiB, {tps:,.0f} tokens/s"
                  + (f", {rec['ratio_to_fastest_within']:.2f}x {best['config']}" if best else ""), flush=True)
    return records


def table(records) -> str:
    lines = ["| depth | trainer | budget MiB | plan (backprop/checkpoint/remat/rebuild) | peak MiB | tokens/s | vs fastest fixed within budget |",
             "|---:|---|---:|---|---:|---:|---|"]
    for r in records:
        budget = "-" if r["budget"] is None else f"{r['budget'] / 2**20:.0f}"
        plan = "-" if "plan" not in r else "/".join(str(r["plan"].get(k, 0))
                                                    for k in ("backprop", "checkpoint", "remat", "rebuild"))
        vs = "-" if r.get("ratio_to_fastest_within") is None else \
            f"{r['ratio_to_fastest_within']:.2f}x {r['fastest_fixed_within']}"
        lines.append(f"| {r['depth']} | {r['config']} | {budget} | {plan} | {r['peak_device_bytes'] / 2**20:.0f} | "
                     f"{r['tokens_per_sec']:,.0f} | {vs} |")
    return "\n".join(lines)


def plot(records, path) -> None:
    plt = common.pyplot()
    depths = sorted({r["depth"] for r in records})
    fig, axes = plt.subplots(1, len(depths), figsize=(6 * len(depths), 4.5), squeeze=False)
    for ax, depth in zip(axes[0], depths):
        rows = [r for r in records if r["depth"] == depth]
        budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
        xs = np.array(budgets) / 2**20
        for r in rows:
            if r["budget"] is None:  # a fixed trainer: its speed from its own peak on
                ys = [r["tokens_per_sec"] if b >= r["peak_device_bytes"] else np.nan for b in budgets]
                ax.plot(xs, ys, "x--", label=r["config"])
        for name, _ in BUDGETED:
            pts = sorted((r["budget"], r["tokens_per_sec"]) for r in rows if r["config"] == name)
            ax.plot([b / 2**20 for b, _ in pts], [t for _, t in pts], "o-", lw=2, label=name)
        ax.set_xlabel("device-memory budget (MiB)")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"depth {depth}, d_model {records[0].get('d_model', 256)}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def point(args) -> dict:
    """One budgeted trainer (``--point`` name of ``BUDGETED``, ``--budget``) at ``--depth`` blocks."""
    import time
    mesh = make_mesh(jax.devices()[:1])
    kw = dict(BUDGETED)[args.point]
    extra = {"compute_dtype": args.compute_dtype} if args.compute_dtype else {}
    model = ReversibleTransformerLM(args.seq, num_layers=args.depth, d_model=args.d_model, num_heads=args.heads,
                                    dropout_rate=0.0, **extra)
    trainer = common.make_trainer("reversible", model, mesh, memory_budget=args.budget, **kw)
    batches = common.batches(args.seq, args.batch, 3, mesh)
    rec = {"config": args.point, "budget": trainer.memory_budget, "depth": args.depth, "d_model": args.d_model,
           "seq": args.seq, "batch": args.batch}
    try:
        ts = trainer.init()
        for b in batches[:2]:
            ts, m = trainer.train_step(ts, b)
        common.ready(ts, m)
        times = []
        for r in range(args.rounds):
            t0 = time.perf_counter()
            if r == args.rounds - 1:
                trainer.meter = MemoryMeter()
                trainer.meter.start()
            ts, m = trainer.train_step(ts, batches[2])
            common.ready(ts, m)
            times.append(time.perf_counter() - t0)
        peak = trainer.meter.stop()
        plan = trainer.budget_plan
        rec.update(status="ok", tokens_per_sec=args.batch * args.seq / statistics.median(times),
                   peak_device_bytes=peak, memory_method=trainer.meter.method, plan=plan.counts(),
                   plan_peak_bytes=plan.peak, within_budget=peak <= trainer.memory_budget)
    except Exception as e:  # noqa: BLE001 (a refused budget, an out-of-memory step: recorded)
        rec.update(status="error", error=str(e).splitlines()[0][:300])
    return rec


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depths", default="8,32")
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budgets", type=int, default=6, help="budgets spread from exact's peak to standard's")
    p.add_argument("--out", default="bench_budget.json")
    p.add_argument("--plot", default="bench_budget.png")
    p.add_argument("--point", default=None, help="one budgeted trainer: 'budgeted exact' or 'budgeted fused'")
    p.add_argument("--budget", default=None, help="with --point: the memory budget (bytes or '4GiB')")
    p.add_argument("--depth", type=int, default=8, help="with --point")
    p.add_argument("--compute_dtype", default=None, help="with --point (e.g. bfloat16)")
    args = p.parse_args()
    if args.point:
        import json
        rec = point(args)
        print(json.dumps(rec))
        if rec.get("within_budget") is False:  # a budget is a bound: a step over it fails the run
            raise SystemExit(f"{args.point}: measured peak {rec['peak_device_bytes']:,} bytes over its budget "
                             f"{rec['budget']:,}")
        return
    mesh = make_mesh(jax.devices()[:1])
    records = []
    for depth in (int(d) for d in args.depths.split(",")):
        records += run_depth(depth, args, mesh)
        for r in records:
            r["d_model"], r["seq"], r["batch"] = args.d_model, args.seq, args.batch
        common.write_outputs(records, args.out, table, plot, args.plot)  # after each depth: partial results kept
    over = [r for r in records if r.get("within_budget") is False]
    if over:  # a budget is a bound: any budgeted step over its budget fails the bench
        raise SystemExit("measured peak over its budget: " + "; ".join(
            f"depth {r['depth']} {r['config']} at {r['budget']:,} bytes: {r['peak_device_bytes']:,}" for r in over))


if __name__ == "__main__":
    main()
