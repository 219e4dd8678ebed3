"""Sampling speed: cached incremental decoding against recomputing the prefix for every new byte, and the
cost of generating past the context (learned positions re-encode, rotary positions slide the window).

  python scripts/bench_sample.py [--config configs/enwik_small.gin] [--length 512] [--num_samples 1]
                                 [--rounds 3] [--modern_config configs/enwik_modern.gin] [--past 2000]
                                 [--out bench_sample.json]

Both generate ``--length`` bytes from the same prompt with the model of ``--config`` (by default that of
configs/enwik_small.gin: 6 reversible blocks, d_model 128, context 128; random weights: speed does not depend
on them):

* **cached**: `revtrain.sample.generate`, the per-layer key/value caches (one position per layer and byte;
  the last half window re-encoded when the context is full);
* **recompute**: one compiled program of the same shape (a ``lax.scan`` over the new bytes) whose every step
  runs the whole training forward (evaluation mode) over the last ``<= context`` bytes, padded to the
  context, and reads the logits at the last real position.

Each is compiled first, then timed in interleaved rounds (one run of each per round, so machine noise hits
both alike); bytes/s is the median over rounds. Both are greedy, so their first ``context - prompt`` bytes
must agree (checked: a sanity check that both compute the same model).

**Past the context** (``--past``; 0 skips it): for the default model (learned positions: the cache is
refilled by re-encoding the last half context every half context) and the model of ``--modern_config``
(rotary positions: `revtrain.sample.slides`, the ring cache slides, nothing is re-encoded), greedy
generation from a one-byte prompt of ``context - 1`` bytes (they fill the context) and of ``context - 1 +
past`` bytes, timed in interleaved rounds (median). The cost per byte past the context is
``(t_long - t_short) / past``; the ratio divides it by the cost per byte within the context,
``t_short / (context - 1)``. Prints tables and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

try:
    import revtrain  # noqa: F401
except ImportError:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import gin  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from revtrain import loop  # noqa: E402
from revtrain import registry  # noqa: E402,F401  (gin configurables)
from revtrain import sample  # noqa: E402
from revtrain.placement import DATA_AXIS, global_batch, make_mesh  # noqa: E402
from revtrain.trainers import ReversibleTrainer  # noqa: E402

PROMPT = b"[[Category:"


def recompute_program(layers, mesh, context: int, prompt_len: int, length: int):
    """``(params, states, prompt [B, P], keys) -> bytes [B, length]``, greedy, a full forward per byte."""
    def generate(params, states, prompt, keys):
        b = prompt.shape[0]
        text = jnp.zeros((b, max(prompt_len + length, context)), jnp.int32).at[:, :prompt_len].set(prompt)

        def body(text, n):
            start = jnp.maximum(n - context, 0)
            x = lax.dynamic_slice(text, (0, start), (b, context))
            for i, layer in enumerate(layers):
                x = layer.apply(params[i], states[i], x, None, False)[0]
            logits = lax.dynamic_index_in_dim(x, n - start - 1, axis=1, keepdims=False)
            token = sample.next_tokens(logits, keys, 0.0)
            return lax.dynamic_update_slice(text, token[:, None], (0, n)), None

        text, _ = lax.scan(body, text, jnp.arange(prompt_len, prompt_len + length, dtype=jnp.int32))
        return text[:, prompt_len:prompt_len + length]

    mapped = jax.shard_map(generate, mesh=mesh, in_specs=(P(), P(), P(DATA_AXIS), P(DATA_AXIS)),
                           out_specs=P(DATA_AXIS))
    return jax.jit(mapped)


def _config_model(path: str):
    """``(model, context)`` of a config file's ``train.model`` (random weights, seed 0)."""
    from revtrain.ginconfig import include_search_path
    gin.clear_config()
    with include_search_path():
        gin.parse_config_files_and_bindings([path], [], finalize_config=False)
    context = gin.query_parameter("ByteLMTask.sequence_length")
    return loop.TrainConfig().model(seed=0, sequence_length=context), context


def past_context(path: str, past: int, rounds: int) -> dict:
    """Per-byte cost of greedy generation past the context against within it (module docstring)."""
    model, context = _config_model(path)
    trainer = ReversibleTrainer(model, optax.adam(1e-3), make_mesh())
    ts = trainer.init()
    short, long = context - 1, context - 1 + past
    times = {short: [], long: []}
    for length in (short, long):  # compile both
        sample.generate(trainer, ts, b"\n", context, sample.Options(length=length, temperature=0.0))
    for _ in range(rounds):
        for length in (short, long):
            times[length].append(sample.generate(trainer, ts, b"\n", context,
                                                 sample.Options(length=length, temperature=0.0)).seconds)
    t_short, t_long = statistics.median(times[short]), statistics.median(times[long])
    within, beyond = t_short / short, (t_long - t_short) / past
    return {"config": os.path.relpath(path), "slides": sample.slides(model), "context": context,
            "params": model.num_params(), "past": past, "seconds": {str(k): v for k, v in times.items()},
            "us_per_byte_within": 1e6 * within, "us_per_byte_past": 1e6 * beyond, "ratio": beyond / within}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--config", default=str(pathlib.Path(__file__).resolve().parent.parent / "configs" / "enwik_small.gin"))
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modern_config", default=str(pathlib.Path(__file__).resolve().parent.parent / "configs" /
                                                  "enwik_modern.gin"))
    p.add_argument("--past", type=int, default=2000, help="bytes generated past the context (0: skip)")
    p.add_argument("--out", default="bench_sample.json")
    args = p.parse_args(argv)

    model, context = _config_model(args.config)
    mesh = make_mesh()
    trainer = ReversibleTrainer(model, optax.adam(1e-3), mesh)
    ts = trainer.init()
    opts = sample.Options(length=args.length, temperature=0.0, num_samples=args.num_samples)

    batch = -(-args.num_samples // mesh.size) * mesh.size
    rows = np.tile(np.frombuffer(PROMPT, np.uint8).astype(np.int32), (batch, 1))
    inputs = global_batch({"prompt": rows, "keys": sample.sample_keys(0, batch)}, mesh)
    program = recompute_program(tuple(model.layers), mesh, context, len(PROMPT), args.length)
    recompute_args = (list(ts.params), list(ts.layer_state), inputs["prompt"], inputs["keys"])
    start = time.perf_counter()
    recompute = program.lower(*recompute_args).compile()
    recompute_compile = time.perf_counter() - start

    def run_cached():
        result = sample.generate(trainer, ts, PROMPT, context, opts)
        return result.samples, result.seconds, result.compile_seconds

    def run_recompute():
        start = time.perf_counter()
        out = np.asarray(recompute(*recompute_args))
        return [bytes(r.astype(np.uint8)) for r in out[:args.num_samples]], time.perf_counter() - start, 0.0

    cached_samples, _, cached_compile = run_cached()  # compiles
    times = {"cached": [], "recompute": []}
    for _ in range(args.rounds):
        for name, fn in (("cached", run_cached), ("recompute", run_recompute)):
            samples, seconds, _ = fn()
            times[name].append(seconds)
            if name == "recompute":
                recompute_samples = samples
    agree = context - len(PROMPT)
    same_start = all(a[:agree] == b[:agree] for a, b in zip(cached_samples, recompute_samples))
    generated = args.length * args.num_samples
    rate = {k: generated / statistics.median(v) for k, v in times.items()}
    record = {
        "model": {"layers": len(model.layers), "params": model.num_params(), "context": context},
        "length": args.length, "num_samples": args.num_samples, "devices": mesh.size,
        "platform": jax.devices()[0].platform, "cpu_count": os.cpu_count(),
        "bytes_per_sec": rate, "seconds": times,
        "compile_seconds": {"cached": cached_compile, "recompute": recompute_compile},
        "speedup": rate["cached"] / rate["recompute"],
        "greedy_agree_within_context": same_start,
    }
    print(f"{'path':<10} {'bytes/s':>10} {'s per run':>10} {'compile s':>10}")
    for name in ("cached", "recompute"):
        print(f"{name:<10} {rate[name]:>10,.0f} {statistics.median(times[name]):>10.3f} "
              f"{record['compile_seconds'][name]:>10.1f}")
    print(f"cached / recompute: {record['speedup']:.1f}x ({args.length} bytes x {args.num_samples} sample(s), "
          f"context {context}, {mesh.size} {record['platform']} device(s)); greedy outputs agree on the first "
          f"{agree} bytes: {same_start}")
    if args.past:
        record["past_context"] = [past_context(path, args.past, args.rounds) for path in (args.config,
                                                                                          args.modern_config)]
        print(f"\n{'past the context':<24} {'slides':>7} {'us/byte within':>15} {'us/byte past':>13} {'ratio':>6}")
        for r in record["past_context"]:
            print(f"{r['config']:<24} {str(r['slides']):>7} {r['us_per_byte_within']:>15,.0f} "
                  f"{r['us_per_byte_past']:>13,.0f} {r['ratio']:>6.2f}")
        print(f"(greedy from a 1-byte prompt: {context - 1} bytes within the {context}-byte context, then "
              f"{args.past} past it; random weights)")
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    if not same_start:
        sys.exit("the cached and recomputed greedy samples differ within the context")
    return record


if __name__ == "__main__":
    main()
