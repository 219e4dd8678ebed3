"""ReversibleTrainer with replicated against sharded state (``shard_state``), with and without offload, on
several devices (docs/sharding.md).

  python scripts/bench_shard.py [--shard_devices 4] [--depth 6] [--d_model 128] [--heads 4] [--seq 128]
                                [--batch 32] [--rounds 5] [--out bench_shard.json]

How: on ``--shard_devices`` forced CPU devices (the script re-runs itself with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` unless that flag is already set), the default model
(configs/enwik_small.gin: 6 layers, d_model 128, T 128, batch 32, AdamW) on real batches. Each configuration
of ``SHARD_CONFIGS`` is built and stepped once (start-up seconds), then all are timed in ``--rounds``
interleaved rounds (one step of each per round; the median). Then one metered step each: peak device bytes
(the memory meter, an estimate on the CPU) and ``host_state_bytes`` per device. All in one process.

Outputs: ``--out`` (default bench_shard.json: a record per configuration and ``ratios``, sharded /
replicated tokens/s, host bytes and peak device bytes) and a markdown table on stdout. No make target.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import bench_common as common  # first: puts the repository on sys.path when revtrain is not installed

import optax  # noqa: E402

from revtrain.memory import host_state_bytes  # noqa: E402
from revtrain.models import ReversibleTransformerLM  # noqa: E402
from revtrain.placement import make_mesh  # noqa: E402

# (label, keyword arguments of ReversibleTrainer)
SHARD_CONFIGS = [
    ("replicated + offload", {"offload": True}),
    ("sharded + offload", {"offload": True, "shard_state": True}),
    ("replicated", {}),
    ("sharded", {"shard_state": True}),
]


def shard_sweep(args) -> dict:
    """Replicated vs sharded state on the devices of this process (see the module note): one record per
    configuration with ``tokens_per_sec``, ``startup_s`` (seconds), ``peak_device_bytes`` and
    ``host_state_bytes`` (bytes per device), and ``ratios``: sharded / replicated tokens/s and host bytes,
    with and without offload."""
    mesh = make_mesh()
    seq, batch = args.seq, args.batch
    batches = common.batches(seq, batch, 4, mesh)
    configs = [c for c, _ in SHARD_CONFIGS]
    kwargs = dict(SHARD_CONFIGS)
    trainers = {}

    def build(c):
        model = ReversibleTransformerLM(seq, num_layers=args.depth, d_model=args.d_model, num_heads=args.heads,
                                        dropout_rate=0.0)
        trainers[c] = common.make_trainer("reversible", model, mesh, optax.adamw(1e-4, weight_decay=0.01),
                                          **kwargs[c])
        return trainers[c]

    measured = common.measure(configs, build, batches, args.rounds)
    records = []
    for c in configs:
        t = trainers[c]
        ts = t.init()
        t.meter.start()  # the meter of `common.measure` (its compiled-memory analyses are cached)
        ts, m = t.train_step(ts, batches[0])
        common.ready(ts, m)
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
    """The markdown table of ``shard_sweep``: a row per configuration, then the ratios."""
    rows = ["| state | devices | tokens/s | peak device MiB | host state MiB / device | start-up s |",
            "|---|---|---|---|---|---|"]
    for r in result["records"]:
        rows.append(f"| {r['config']} | {r['devices']} | {r['tokens_per_sec']:,.0f} | "
                    f"{r['peak_device_bytes'] / 2**20:.1f} | {r['host_state_bytes'] / 2**20:.2f} | {r['startup_s']:.1f} |")
    rows.append("")
    rows += [f"sharded / replicated {k}: {v:.3f}" for k, v in result["ratios"].items()]
    return "\n".join(rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--shard_devices", type=int, default=4, help="forced CPU devices")
    p.add_argument("--depth", type=int, default=6, help="reversible blocks")
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per configuration")
    p.add_argument("--out", default="bench_shard.json")
    args = p.parse_args()
    flag = f"--xla_force_host_platform_device_count={args.shard_devices}"
    if flag not in os.environ.get("XLA_FLAGS", ""):  # JAX reads it when its backend starts: run again
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip())
        sys.exit(subprocess.run([sys.executable, *sys.argv], env=env).returncode)
    common.write_outputs(shard_sweep(args), args.out, shard_table)


if __name__ == "__main__":
    main()
