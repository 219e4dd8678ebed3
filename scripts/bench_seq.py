"""Memory and speed of blockwise against dense attention over the sequence length (``make bench-long``,
docs/long_sequences.md).

  python scripts/bench_seq.py [--seqs 512,1024,4096,16384,65536] [--depth 4] [--d_model 256] [--heads 4]
                              [--batch 1] [--attention_block 512] [--ff_chunk 1024] [--head_chunk 1024]
                              [--dense_max 4096] [--one_step_from 16384] [--steps 3] [--exact_seq 512]
                              [--out bench_long.json] [--plot bench_long.png]

How: ReversibleTrainer with offload on the same model with exact blockwise attention (plus the chunked
feed-forward and head loss) and with dense attention (only up to ``--dense_max``: beyond it dense
attention's ``[B, H, T, T]`` arrays do not fit a small machine), over the sequence lengths ``--seqs``;
StandardTrainer's peak from its compiled step program beside them (no run: arguments + temporaries +
non-donated outputs, from ``memory_analysis()``). Below ``--one_step_from`` each configuration gets a
warm-up step, a metered step and ``--steps`` timed steps (blockwise and dense in interleaved rounds; the
median); from it on, one metered step whose time excludes compilation (JAX's compile-time events). Peak
device bytes: the memory meter in this process on the CPU (an estimate), a fresh subprocess per
configuration on GPU/TPU (the allocator's peak cannot be reset). It also checks blockwise against dense at
``--exact_seq`` in float32: training losses over 5 steps and the attention parameters' gradients.

Outputs: ``--out`` (default bench_long.json: ``config``, ``records`` per T x attention x trainer,
``exactness``), ``--plot`` (default bench_long.png: peak MiB and tokens/s against T, log-log) and a markdown
table on stdout.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import bench_common as common  # first: puts the repository on sys.path when revtrain is not installed

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from revtrain.memory import MemoryMeter  # noqa: E402
from revtrain.models import ReversibleTransformerLM  # noqa: E402
from revtrain.placement import DATA_AXIS, make_mesh  # noqa: E402
from revtrain.trainers import ReversibleTrainer, StandardTrainer  # noqa: E402

SEQ_KINDS = ("blockwise", "dense")


def _seq_model(seq, args, kind):
    """The benchmark's LM at length ``seq``: blockwise attention + chunked feed-forward and head, or dense."""
    chunks = {"attention_block": args.attention_block, "ff_chunk": args.ff_chunk, "head_chunk": args.head_chunk}
    return ReversibleTransformerLM(seq, num_layers=args.depth, d_model=args.d_model, num_heads=args.heads,
                                   dropout_rate=0.0, **(chunks if kind == "blockwise" else {}))


def _offload_trainer(seq, args, kind, mesh):
    """ReversibleTrainer with offload (Adam 1e-4) on ``_seq_model``."""
    return ReversibleTrainer(_seq_model(seq, args, kind), optax.adam(1e-4), mesh, seed=0, offload=True)


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
    common.ready(ts, m)
    return ts, time.perf_counter() - t0 - (clock.seconds - c0)


def _seq_point_memory(seq, kind, args) -> tuple[int, str]:
    """Peak device bytes of one ReversibleTrainer + offload step at length ``seq`` (after a warm-up step
    below ``--one_step_from``), in this process. Returns ``(bytes, memory meter method)``."""
    mesh = make_mesh()
    trainer = _offload_trainer(seq, args, kind, mesh)
    trainer.meter = MemoryMeter()
    batches = common.batches(seq, args.batch, 2, mesh)
    ts = trainer.init()
    if seq < args.one_step_from:
        ts, m = trainer.train_step(ts, batches[1])
        common.ready(ts, m)
    trainer.meter.start()
    ts, m = trainer.train_step(ts, batches[0])
    common.ready(ts, m)
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

    params, states = model.param_shapes(), model.state_shapes()  # shapes only: no weight is made here
    tokens = jax.ShapeDtypeStruct((args.batch, seq), jnp.int32)
    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P(), P(DATA_AXIS), P()), out_specs=(P(), P(), P())),
                 donate_argnums=(0, 1))
    compiled = fn.lower(params, jax.eval_shape(trainer.tx.init, params), states,
                        {"inputs": tokens, "targets": tokens}, jax.ShapeDtypeStruct((2,), jnp.uint32)).compile()
    a = compiled.memory_analysis()
    return int(a.argument_size_in_bytes + a.temp_size_in_bytes + max(0, a.output_size_in_bytes - a.alias_size_in_bytes))


def _seq_memory_in_subprocess(seq, kind, args) -> tuple[int, str]:
    """``_seq_point_memory`` in a fresh process (this script with ``--seq_memory_only``)."""
    return common.peak_in_subprocess(__file__, ["--seq_memory_only", f"{seq},{kind}", *_seq_argv(args)])


def _seq_argv(args) -> list[str]:
    return [f"--{name}={getattr(args, name)}" for name in
            ("depth", "d_model", "heads", "batch", "attention_block", "ff_chunk", "head_chunk", "one_step_from")]


def exactness(args, mesh) -> dict:
    """Blockwise vs dense attention in float32 at ``--exact_seq``: the training losses of 5 ReversibleTrainer
    steps from the same weights on the same batches, and whole-model backprop's gradients of every block's
    attention parameters (max |difference| / max |dense| per leaf, the worst leaf)."""
    seq, steps = args.exact_seq, 5
    batches = common.batches(seq, args.batch, steps, mesh)
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
    """The sweep over ``--seqs`` (see the module note): ``{"config", "records", "exactness"}``, records with
    ``peak_device_bytes`` (bytes) and ``tokens_per_sec`` (None for the standard trainer's compiled estimate)."""
    mesh = make_mesh()
    device = jax.devices()[0]
    on_cpu = device.platform == "cpu"
    clock = _CompileClock()
    records = []
    for seq in args.seqs:
        kinds = [k for k in SEQ_KINDS if k == "blockwise" or seq <= args.dense_max]
        one_step = seq >= args.one_step_from
        batches = common.batches(seq, args.batch, 1 if one_step else 2 + args.steps, mesh)
        times = collections.defaultdict(list)
        peaks = {}
        trainers, states = {}, {}
        for kind in kinds:
            trainer = _offload_trainer(seq, args, kind, mesh)
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
    """The markdown table of ``run_seq``: peak device MiB and tokens/s per T x trainer x attention, and the
    blockwise / dense tokens/s ratio."""
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
    """Peak device MiB and tokens/s against T, log-log, a line per trainer x attention; PNG at ``path``."""
    plt = common.pyplot()
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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--seqs", default="512,1024,4096,16384,65536", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--depth", type=int, default=4, help="reversible blocks")
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="timed steps (interleaved rounds) below --one_step_from")
    p.add_argument("--attention_block", type=int, default=512)
    p.add_argument("--ff_chunk", type=int, default=1024)
    p.add_argument("--head_chunk", type=int, default=1024)
    p.add_argument("--dense_max", type=int, default=4096, help="longest T run with dense attention")
    p.add_argument("--one_step_from", type=int, default=16384, help="from this T on: one metered, timed step")
    p.add_argument("--exact_seq", type=int, default=512, help="T of the blockwise-vs-dense check (0: skip)")
    p.add_argument("--out", default="bench_long.json")
    p.add_argument("--plot", default="bench_long.png")
    p.add_argument("--seq_memory_only", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.seq_memory_only:
        length, kind = args.seq_memory_only.split(",")
        print(*_seq_point_memory(int(length), kind, args))
        return
    common.write_outputs(run_seq(args), args.out, table_seq, plot_seq, args.plot)


if __name__ == "__main__":
    main()
